"""The node agent: one watched state feeding the DNS server and the proxier.

Ordering guarantee. The source writes the main StateStore; the proxier syncs
from it. DNS does not read that store directly: it reads a DnsView, a state
the agent derives from two inputs, the store now (C) and the store as it was
at the version the proxier last put into the kernel (P):

- a Service that needs rules (it has a ClusterIP and ports) enters DNS only
  once P has it, and a changed ClusterIP, ports or type show in DNS only once
  P has them: until then DNS keeps the old record, whose rules are still in
  the kernel. A name never resolves to an address that does not work yet.
- a deleted Service, and an endpoint that went away or stopped being ready,
  leave DNS at once (from C): DNS first, rules after.
- Services without rules (headless, ExternalName, other proxies' Services)
  and Namespaces, Pods and Nodes follow the store directly.
With --proxy-mode none there are no rules to wait for: the view follows the store.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import fields
from types import MappingProxyType
from typing import Callable

from aiohttp import web
from prometheus_client import Counter, Histogram

from .config import ConfigError, load
from .health import HealthServer
from .localdns import LocalDNS, LocalDNSError
from .localdns import cleanup as localdns_cleanup
from .metrics import DNS as DNS_REGISTRY
from .metrics import REGISTRY
from .model import KINDS, Endpoint, EndpointSlice, Service
from .proxy.healthcheck import aiohttp_handler
from .proxy.proxier import Proxier
from .sources.loader import make_source
from .state import ClusterState, Delta, StateStore, Subscriber

log = logging.getLogger(__name__)

DNS_PROGRAMMING = Histogram(
    "coredns_kubernetes_dns_programming_duration_seconds",
    "Time from an EndpointSlice change (its last-change-trigger-time) to DNS serving it.",
    ["service_kind"], registry=DNS_REGISTRY,
    buckets=tuple(0.001 * 2 ** i for i in range(20)))
RELOADS = Counter("clusterdns_config_reloads_total",
                  "Configuration reloads by result (applied, unchanged, failed).",
                  ["result"], registry=REGISTRY)

# States kept for versions the proxier may still report as applied. The
# proxier syncs the newest state, so old ones are almost never asked for;
# when one was dropped the nearest older one is used (showing less, never more).
HISTORY = 32


def needs_rules(svc: Service) -> bool:
    """True when the proxier programs rules for this Service (see servicemap)."""
    return bool(svc.cluster_ips and svc.ports and not svc.headless
                and not svc.is_external_name and not svc.proxy_name)


def _shape(svc: Service) -> tuple:
    """The fields whose change needs new rules before DNS may show it."""
    return (svc.type, svc.cluster_ips, svc.ports, svc.headless, svc.external_name)


def _ready_addresses(slices: tuple[EndpointSlice, ...]) -> set[str]:
    return {a for sl in slices for ep in sl.endpoints if ep.ready for a in ep.addresses}


def _filter_slice(sl: EndpointSlice, allowed: set[str]) -> EndpointSlice:
    """The slice without ready endpoints the kernel does not route to yet."""
    keep: list[Endpoint] = []
    dropped = False
    for ep in sl.endpoints:
        if ep.ready and not all(a in allowed for a in ep.addresses):
            dropped = True
            continue
        keep.append(ep)
    if not dropped:
        return sl
    return EndpointSlice(sl.namespace, sl.name, sl.service, sl.address_type, tuple(keep), sl.ports,
                         sl.trigger_time)


class DnsView:
    """The state DNS serves in the agent; quacks like a StateStore for readers.

    `current` and `subscribe(fn(old, new, delta))` as StateStore; the agent
    calls `applied(version)` after each successful proxier sync.
    """

    def __init__(self, store: StateStore, clock: Callable[[], float] = time.monotonic,
                 follow: bool = False) -> None:
        self.store = store
        self.clock = clock
        self.follow = follow   # no proxier (--proxy-mode none): every version counts as applied
        self._subscribers: list[Subscriber] = []
        self._history: dict[int, ClusterState] = {}
        self._deltas: list[tuple[int, frozenset, bool]] = []   # (version, service keys, full)
        self.applied_state = ClusterState()
        self.applied_version = -1
        self._services: dict[tuple[str, str], Service] = {}
        self._slices: dict[tuple[str, str], EndpointSlice] = {}
        self._slice_keys: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        self.current = ClusterState()
        self._version = 0
        self._observed: dict[tuple[str, str], float] = {}   # slice key -> last trigger time observed
        if follow:
            self.applied_state, self.applied_version = store.current, store.current.version
        self._remember(store.current)
        # Services already in the store wait for a sync like any change.
        self._deltas.append((store.current.version, frozenset(store.current.services), True))
        self._recompute(set(store.current.services), store.current, full=True)
        store.subscribe(self._on_store)

    # -- StateStore-compatible reading side
    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    # -- inputs
    def _remember(self, state: ClusterState) -> None:
        self._history[state.version] = state
        if len(self._history) > HISTORY:
            for v in sorted(self._history)[:-HISTORY]:
                if v != self.applied_version:
                    del self._history[v]

    def _on_store(self, old: ClusterState, new: ClusterState, delta: Delta) -> None:
        if self.follow:
            self.applied_state, self.applied_version = new, new.version
            self._history = {new.version: new}
            self._recompute(set(delta.services) | (set(old.services) | set(new.services) if delta.full else set()),
                            new, kinds=delta.kinds)
            return
        self._remember(new)
        keys = set(delta.services)
        if delta.full and ("Service" in delta.kinds or "EndpointSlice" in delta.kinds):
            keys |= set(old.services) | set(new.services)
        self._deltas.append((new.version, frozenset(keys), delta.full))
        self._recompute(keys, new, kinds=delta.kinds)

    def applied(self, version: int) -> None:
        """The proxier has put the state of `version` into the kernel."""
        if version <= self.applied_version:
            return
        state = self._history.get(version)
        if state is None:
            older = [v for v in self._history if v <= version]
            if not older:
                log.debug("applied version %d is unknown; ignored", version)
                return
            version = max(older)
            state = self._history[version]
        self.applied_version, self.applied_state = version, state
        for v in [v for v in self._history if v < version]:
            del self._history[v]
        keys: set = set()
        rest = []
        for v, k, _full in self._deltas:
            if v <= version:
                keys |= k
            else:
                rest.append((v, k, _full))
        self._deltas = rest
        self._recompute(keys, self.store.current)

    # -- the view
    def _entry(self, key: tuple[str, str], now: ClusterState) -> tuple[Service | None, tuple[EndpointSlice, ...]]:
        c_svc = now.services.get(key)
        if c_svc is None:
            return None, ()
        c_slices = now.slices_for(*key)
        if not needs_rules(c_svc):
            return c_svc, c_slices
        p_svc = self.applied_state.services.get(key)
        if p_svc is None:
            return None, ()       # new: not before its rules
        svc = c_svc if _shape(p_svc) == _shape(c_svc) else p_svc
        allowed = _ready_addresses(self.applied_state.slices_for(*key))
        return svc, tuple(_filter_slice(sl, allowed) for sl in c_slices)

    def _recompute(self, keys: set, now: ClusterState, full: bool = False, kinds: frozenset = frozenset()) -> None:
        changed = set()
        for key in keys:
            svc, slices = self._entry(key, now)
            old_svc = self._services.get(key)
            old_keys = self._slice_keys.get(key, ())
            old_slices = tuple(self._slices[k] for k in old_keys)
            if svc == old_svc and slices == old_slices:
                continue
            changed.add(key)
            for k in old_keys:
                self._slices.pop(k, None)
            if svc is None:
                self._services.pop(key, None)
                self._slice_keys.pop(key, None)
                continue
            self._services[key] = svc
            self._slice_keys[key] = tuple(sl.key for sl in slices)
            for sl in slices:
                self._slices[sl.key] = sl
        base = self.current
        others = (now.namespaces is not base.namespaces or now.pods is not base.pods
                  or now.nodes is not base.nodes or self._synced(now) != base.synced)
        if not changed and not others and not full:
            return
        self._publish(now, changed, kinds, full)

    def _observe_programming(self, now: ClusterState, changed: set) -> None:
        """coredns_kubernetes_dns_programming_duration_seconds: from the EndpointSlice
        trigger time to the change being served, for slices DNS now shows as they are."""
        wall = time.time()
        for key in changed:
            svc = self._services.get(key)
            if svc is None:
                continue
            kind = "cluster_ip" if needs_rules(svc) else (
                "headless_with_selector" if svc.headless else "")
            if not kind:
                continue
            for skey in self._slice_keys.get(key, ()):
                sl = self._slices[skey]
                if sl.trigger_time is None or now.slices.get(skey) is not sl:
                    continue
                if sl.trigger_time > self._observed.get(skey, 0.0):
                    self._observed[skey] = sl.trigger_time
                    DNS_PROGRAMMING.labels(kind).observe(max(0.0, wall - sl.trigger_time))
        if len(self._observed) > 2 * max(1, len(now.slices)):
            self._observed = {k: v for k, v in self._observed.items() if k in now.slices}

    def _synced(self, now: ClusterState) -> frozenset:
        """Nothing counts as synced before the first rule sync: DNS then answers SERVFAIL,
        not NXDOMAIN, for the Services it cannot show yet (after an agent restart their
        rules may well be in the kernel; a negative answer would be wrong and cached)."""
        return now.synced if self.follow or self.applied_version >= 0 else frozenset()

    def _publish(self, now: ClusterState, changed: set, kinds: frozenset, full: bool) -> None:
        old = self.current
        self._version += 1
        new = ClusterState(
            version=self._version,
            services=MappingProxyType(dict(self._services)) if changed or full else old.services,
            slices=MappingProxyType(dict(self._slices)) if changed or full else old.slices,
            namespaces=now.namespaces, pods=now.pods, nodes=now.nodes,
            synced=self._synced(now), serial=max(now.serial, old.serial + (1 if changed else 0)))
        self._observe_programming(now, changed)
        view_kinds = set(kinds) | ({"Service", "EndpointSlice"} if changed else set())
        delta = Delta(frozenset(changed), frozenset(view_kinds), full)
        self.current = new
        for fn in list(self._subscribers):
            try:
                fn(old, new, delta)
            except Exception:  # one consumer's bug must not stop the others
                log.exception("DNS view subscriber failed")

    def unsubscribe(self, fn: Subscriber) -> None:
        if fn in self._subscribers:
            self._subscribers.remove(fn)


# ---------------------------------------------------------------- the agent

# Which configuration fields each component reads, to restart only what a
# reload changed. Anything not listed elsewhere belongs to DNS.
SOURCE_FIELDS = {"manifest", "kubeconfig", "demo", "pods", "autopath", "node_name"}
PROXY_FIELDS = {"node_name", "node_ips", "cluster_cidrs", "service_cidrs", "masquerade_all",
                "masquerade_bit", "nodeport_addresses", "localhost_nodeports", "proxy_mode", "apply",
                "ip_family", "sync_period", "min_sync_period", "demo"}
HEALTH_FIELDS = {"health_listen", "metrics_listen", "proxy_metrics_listen", "proxy_mode"}
AGENT_FIELDS = {"lameduck", "log_level", "config_file", "loop", "command", "cleanup"}
LOCAL_FIELDS = {"local_ips", "apply", "demo"}


def changed_fields(old, new) -> set[str]:
    return {f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)}


def demo_banner(cfg, bound: list[tuple[str, int]]) -> str:
    host, port = bound[0] if bound else cfg.listen_addresses()[0]
    at = f"@{host}" + (f" -p {port}" if port != 53 else "")
    return ("clusterdns agent: demo cluster (no kubeconfig, no --manifest); rules are printed, not applied.\n"
            f"  query it:  dig {at} testapp-svc.testapp.svc.cluster.local\n"
            f"  trace it:  clusterdns trace testapp-svc --from-pod testapp/client")


class Agent:
    """Source -> StateStore -> Proxier, and -> DnsView -> DnsService; plus health,
    local DNS addresses, lameduck shutdown and configuration reload.

    executor: the proxier's CommandRunner (tests pass a slow or recording one).
    argv: the command line, re-read on reload (SIGHUP or a changed --config).
    """

    def __init__(self, cfg, *, argv: list[str] | None = None, executor=None, forwarder=None,
                 localdns_runner=None) -> None:
        self.cfg = cfg
        self.argv = argv
        self.executor = executor
        self.forwarder = forwarder
        self.localdns_runner = localdns_runner
        self.store = StateStore()
        self.view = DnsView(self.store, follow=cfg.proxy_mode == "none")
        self.source = None
        self.proxier = None
        self.dns = None
        self.health = None
        self.localdns = None
        self.reloads = 0
        self.reload_errors = 0
        self._tasks: dict[str, "asyncio.Task"] = {}
        self._stopping = None
        self._config_stamp = None
        self._last_local_check = 0.0

    # -- readiness
    def not_ready(self) -> list[str]:
        return self.health.not_ready() if self.health else ["starting"]

    def _add_ready_checks(self, health) -> None:
        for kind in KINDS:
            health.add_ready_check(f"{kind} not synced", lambda k=kind: k in self.store.current.synced)
        health.add_ready_check("first rule sync not done",
                               lambda: self.proxier is None or self.proxier.syncs > 0)
        health.add_ready_check("dns", lambda: self.dns is not None and self.dns.synced)

    # -- building blocks
    def _make_proxier(self):
        if self.cfg.proxy_mode == "none":
            return None
        proxier = Proxier(self.cfg, self.store, executor=self.executor)
        proxier.add_listener(self._on_rules_applied)
        return proxier

    def _on_rules_applied(self, version: int) -> None:
        self.view.applied(version)
        # A proxier full sync may insert its jumps above ours: re-check soon after.
        if self.localdns is not None and self.clock() - self._last_local_check > 5.0:
            self._last_local_check = self.clock()
            self._spawn("localdns-check", self._check_localdns())

    @staticmethod
    def clock() -> float:
        return time.monotonic()

    async def _check_localdns(self) -> None:
        try:
            await self.localdns.check()
        except LocalDNSError as exc:
            log.error("local DNS check failed: %s", exc)

    def _spawn(self, name: str, coro) -> None:
        """Run a named background task; a newer one replaces it (a check already running is kept)."""
        old = self._tasks.get(name)
        if old is not None and not old.done():
            if name == "localdns-check":
                coro.close()
                return
            old.cancel()
        self._tasks[name] = asyncio.ensure_future(coro)

    async def _start_dns(self) -> None:
        from .dns.server import DnsService
        kwargs = {} if self.forwarder is None else {"forwarder": self.forwarder}
        self.dns = DnsService(self.cfg, self.view, **kwargs)
        await self.dns.start()

    async def _stop_dns(self) -> None:
        if self.dns is None:
            return
        await self.dns.stop()
        self.view.unsubscribe(self.dns._on_state)
        self.dns = None

    async def _start_localdns(self) -> None:
        if not self.cfg.local_ips:
            return
        if not self.cfg.applying:
            log.warning("--local-ip given but not applying (--dry-run or demo): "
                        "the addresses must already exist on this host")
            return
        self.localdns = LocalDNS(self.cfg.local_ips, self.localdns_runner)
        await self.localdns.setup()
        self._spawn("localdns", self.localdns.run())

    async def _start_health(self) -> None:
        health = HealthServer(self.cfg, roles=("dns",) if self.cfg.proxy_mode == "none" else ("dns", "proxy"))
        self._add_ready_checks(health)

        async def proxier_health(request):
            if self.proxier is None:
                return web.Response(text="proxier disabled (--proxy-mode none)\n")
            return await aiohttp_handler(self.proxier.health.respond)(request)
        health.add_route("/healthz", proxier_health)
        health.add_route("/livez", proxier_health)
        await health.start()
        if self.health is not None:
            health.lameduck = self.health.lameduck
        self.health = health

    def _start_source(self) -> None:
        self.source = make_source(self.cfg, self.store)
        self._spawn("source", self.source.run())

    def _start_proxier(self) -> None:
        self.proxier = self._make_proxier()
        if self.proxier is not None:
            self._spawn("proxier", self.proxier.run())

    async def _stop_proxier(self) -> None:
        if self.proxier is None:
            return
        await self.proxier.stop()
        task = self._tasks.pop("proxier", None)
        if task is not None:
            task.cancel()
            await _quiet(task)
        self.store.unsubscribe(self.proxier._on_change)
        self.proxier = None

    # -- lifecycle
    async def start(self) -> None:
        """Everything up; raises UsageError (bad input) or OSError (an address in use)."""
        self._stopping = asyncio.Event()
        self._config_stamp = _stamp(self.cfg.config_file)
        self._start_source()          # a broken manifest raises here
        self._start_proxier()
        await self._start_localdns()  # before DNS: it listens on these addresses
        await self._start_dns()
        await self._start_health()
        if self.cfg.config_file:
            self._spawn("config-watch", self._watch_config())

    def banner(self) -> str:
        from .dns.server import banner
        text = banner(self.dns).replace("clusterdns dns", "clusterdns agent", 1)
        mode = self.cfg.proxy_mode if self.proxier else "none"
        text += f"; proxier: {mode} ({'applying' if self.cfg.applying else 'printing'})"
        if self.health:
            for kind, label in (("health", "health/ready"), ("metrics", "DNS metrics"),
                                ("proxy-metrics", "proxy metrics")):
                if self.health.bound_kinds.get(kind):
                    text += f"; {label} on " + ", ".join(f"{h}:{p}" for h, p in self.health.bound_kinds[kind])
        if self.cfg.demo:
            text += "\n" + demo_banner(self.cfg, self.dns.bound)
        return text

    def begin_shutdown(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def wait(self) -> int:
        """Until shutdown is asked (then lameduck) or the source fails; the exit code."""
        waiter = asyncio.ensure_future(self._stopping.wait())
        code = 0
        while not self._stopping.is_set():
            watched = [t for n, t in self._tasks.items() if n in ("source", "proxier")]
            # The timeout picks up tasks a reload started meanwhile.
            done, _ = await asyncio.wait([waiter, *watched], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            # A task a reload replaced ends too: only a current one ending is fatal.
            failed = [t for t in done if t is not waiter and t in self._tasks.values()]
            for t in failed:
                exc = None if t.cancelled() else t.exception()
                log.error("%s stopped: %s", _task_name(self._tasks, t), exc or "ended")
            if failed:
                code = 1
                break
        if not code and self.cfg.lameduck > 0:
            log.info("shutting down: lameduck for %gs (still answering, /ready 503)", self.cfg.lameduck)
            self.health.lameduck = True
            await asyncio.sleep(self.cfg.lameduck)
        waiter.cancel()
        await self.stop()
        return code

    async def stop(self) -> None:
        """Stop serving. Rules and local addresses stay in the kernel, as kube-proxy's and
        NodeLocal DNSCache's do across restarts; `clusterdns proxy --cleanup` removes them."""
        if self.proxier is not None:
            await self.proxier.stop()
        for t in self._tasks.values():
            t.cancel()
        for t in list(self._tasks.values()):
            await _quiet(t)
        self._tasks.clear()
        await self._stop_dns()
        if self.health is not None:
            await self.health.stop()
        if self.proxier is not None and self.cfg.applying:
            log.info("agent stopped (state version %d; rules of version %d stay in the kernel)",
                     self.store.current.version, self.proxier.applied_version)
        else:
            log.info("agent stopped (state version %d)", self.store.current.version)

    # -- reload
    async def _watch_config(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            stamp = _stamp(self.cfg.config_file)
            if stamp != self._config_stamp:
                self._config_stamp = stamp
                log.info("%s changed; reloading the configuration", self.cfg.config_file)
                await self.reload()

    async def reload(self) -> bool:
        """Re-read the command line and --config file; restart what changed.

        A bad configuration is reported and the running one kept (False)."""
        if self.argv is None:
            log.warning("reload: the command line is unknown; nothing to re-read")
            return False
        try:
            new = load(self.argv)
        except ConfigError as exc:
            self.reload_errors += 1
            RELOADS.labels("failed").inc()
            log.error("reload failed, keeping the running configuration: %s", exc)
            return False
        changed = changed_fields(self.cfg, new) - AGENT_FIELDS - {"config_file"}
        old, self.cfg = self.cfg, new
        if new.log_level != old.log_level:
            logging.getLogger().setLevel(new.log_level.upper())
        if not changed:
            log.info("reload: configuration unchanged")
            RELOADS.labels("unchanged").inc()
            return True
        log.info("reload: changed %s", ", ".join(sorted(changed)))
        try:
            if changed & SOURCE_FIELDS:
                task = self._tasks.pop("source", None)
                if task is not None:
                    task.cancel()
                    await _quiet(task)
                self._start_source()
            if changed & PROXY_FIELDS:
                self.view.follow = new.proxy_mode == "none"
                if self.view.follow:
                    self.view.applied(self.store.current.version)
                await self._stop_proxier()
                self._start_proxier()
                if self.proxier is not None:
                    self.proxier.request_sync()
            if changed & LOCAL_FIELDS and self.localdns is not None:
                t = self._tasks.pop("localdns", None)
                if t is not None:
                    t.cancel()
                await localdns_cleanup(self.localdns.runner)
                self.localdns = None
            if changed & LOCAL_FIELDS:
                await self._start_localdns()
            dns_changed = changed - SOURCE_FIELDS - PROXY_FIELDS - HEALTH_FIELDS
            if dns_changed or "local_ips" in changed:
                await self._stop_dns()
                await self._start_dns()
            if changed & HEALTH_FIELDS:
                await self.health.stop()
                await self._start_health()
        except Exception as exc:   # a half-applied reload: say so loudly; the process keeps running
            self.reload_errors += 1
            RELOADS.labels("failed").inc()
            log.error("reload could not apply the new configuration: %s", exc)
            return False
        self.reloads += 1
        RELOADS.labels("applied").inc()
        return True


def _stamp(path: str):
    if not path:
        return None
    try:
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        return ()


async def _quiet(task) -> None:
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


def _task_name(tasks: dict, task) -> str:
    for name, t in tasks.items():
        if t is task:
            return name
    return "task"

