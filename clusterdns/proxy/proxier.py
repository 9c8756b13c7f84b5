"""The Proxier: keeps the kernel's Service rules equal to the watched state.

It subscribes to the StateStore, remembers which Services changed since the
last successful sync, and lets a bounded-frequency runner decide when to sync:
a full sync at start, every --sync-period, after a failure and when the canary
shows our tables were flushed; partial syncs (only the changed Services'
chains, or only changed nftables elements) otherwise, no more often than
--min-sync-period. Nothing is written before Services and EndpointSlices have
both been listed once. A failed apply leaves the previous rules (restores are
atomic), is logged with the tool's error, counted, and retried as a full sync.
After a successful sync: stale UDP conntrack entries are deleted, health is
updated, and listeners learn which state version is now in the kernel.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import ipaddress
import logging
import sys
import time
from typing import Callable, Iterable, TextIO

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from ..config import Config
from ..metrics import PROXY as REGISTRY  # kube-proxy's series: served on --proxy-metrics-listen
from ..state import ClusterState, Delta, StateStore
from . import iptsave
from .apply import (
    ApplyError,
    CommandRunner,
    IptablesExecutor,
    IpvsExecutor,
    NftExecutor,
    Result,
    SubprocessRunner,
    netlink_netns,
)
from .conntrack import ConntrackCleaner, stale_flows
from .healthcheck import ProxierHealth, ServiceHealthServers, local_endpoint_counts
from .runner import BoundedFrequencyRunner

log = logging.getLogger(__name__)

FULL_SYNC_PERIOD = 3600.0
LARGE_CLUSTER_ENDPOINTS = 1000   # kube-proxy's threshold for rationing iptables-save
NFT_BACKEND_WARN = 1000          # Services from which iptables mode on iptables-nft is warned about

# ------------------------------------------------------------------ metrics (kube-proxy's names)
_BUCKETS = tuple(0.001 * 2 ** i for i in range(15))
SYNC_DURATION = Histogram("kubeproxy_sync_proxy_rules_duration_seconds",
                          "SyncProxyRules latency in seconds", buckets=_BUCKETS, registry=REGISTRY)
SYNC_FULL_DURATION = Histogram("kubeproxy_sync_full_proxy_rules_duration_seconds",
                               "SyncProxyRules latency in seconds for full resyncs",
                               buckets=_BUCKETS, registry=REGISTRY)
SYNC_PARTIAL_DURATION = Histogram("kubeproxy_sync_partial_proxy_rules_duration_seconds",
                                  "SyncProxyRules latency in seconds for partial resyncs",
                                  buckets=_BUCKETS, registry=REGISTRY)
LAST_SYNC = Gauge("kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                  "The last time proxy rules were successfully synced", registry=REGISTRY)
LAST_QUEUED = Gauge("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                    "The last time a sync of proxy rules was queued", registry=REGISTRY)
NETWORK_PROGRAMMING = Histogram(
    "kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds",
    buckets=tuple([0.25 * i for i in range(1, 20)] + [5.0 * i for i in range(1, 13)]
                  + [60.0 * i for i in range(2, 6)]), registry=REGISTRY)
IPTABLES_TOTAL = Gauge("kubeproxy_sync_proxy_rules_iptables_total",
                       "Total number of iptables rules owned by kube-proxy", ["table"], registry=REGISTRY)
IPTABLES_LAST = Gauge("kubeproxy_sync_proxy_rules_iptables_last",
                      "Number of iptables rules written by kube-proxy in last sync", ["table"], registry=REGISTRY)
PARTIAL_FAILURES = Counter("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                           "Cumulative proxy iptables partial restore failures", registry=REGISTRY)
RESTORE_FAILURES = Counter("kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                           "Cumulative proxy rules restore failures (any mode)", registry=REGISTRY)
NO_LOCAL_ENDPOINTS = Gauge("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                           "Number of services with a Local traffic policy and no endpoints",
                           ["traffic_policy"], registry=REGISTRY)
ENDPOINT_CHANGES = Counter("kubeproxy_sync_proxy_rules_endpoint_changes_total",
                           "Cumulative proxy rules Endpoint changes", registry=REGISTRY)
SERVICE_CHANGES = Counter("kubeproxy_sync_proxy_rules_service_changes_total",
                          "Cumulative proxy rules Service changes", registry=REGISTRY)
ENDPOINT_CHANGES_PENDING = Gauge("kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                                 "Pending proxy rules Endpoint changes", registry=REGISTRY)
SERVICE_CHANGES_PENDING = Gauge("kubeproxy_sync_proxy_rules_service_changes_pending",
                                "Pending proxy rules Service changes", registry=REGISTRY)


class BuildInfoCollector:
    """kubernetes_build_info, as kube-proxy's component-base exports it (its label names), filled
    with what is true of clusterdns: major/minor/git_version from the package version, git_commit
    and git_tree_state from clusterdns.version, go_version the Python version ("python3.11.2"),
    compiler the Python implementation ("cpython"), platform GOOS/GOARCH-style. Read at the
    first scrape (it may ask git once), not at import."""

    def collect(self):
        import platform

        from ..version import build_info, build_platform, python_version
        b = build_info()
        major, _, rest = b.version.partition(".")
        minor = rest.partition(".")[0]
        family = GaugeMetricFamily(
            "kubernetes_build_info",
            "A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, "
            "build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.",
            labels=["major", "minor", "git_version", "git_commit", "git_tree_state", "build_date", "go_version",
                    "compiler", "platform"])
        family.add_metric([major, minor, "v" + b.version, b.revision, b.tree_state, b.build_date, python_version(),
                           platform.python_implementation().lower(), build_platform()], 1)
        yield family


REGISTRY.register(BuildInfoCollector())


def node_families(cfg: Config) -> list[int]:
    """The families to program: those of --node-ip (both on a dual-stack node), else IPv4."""
    fams = []
    for ip in cfg.proxy.node_ips:
        v = ipaddress.ip_address(ip).version
        if v not in fams:
            fams.append(v)
    return sorted(fams) or [4]


class PrintingRunner:
    """The runner of --dry-run and the demo: prints what would be applied instead of applying.

    Reads (iptables-save, nft list) answer as an empty kernel would."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out

    async def run(self, argv: Iterable[str], stdin: str | None = None) -> Result:
        argv = tuple(argv)
        out = self.out or sys.stdout
        if stdin is not None and not argv[0].startswith("conntrack"):
            out.write(f"# {' '.join(argv)}\n{stdin}")
            if not stdin.endswith("\n"):
                out.write("\n")
            out.flush()
        return Result(argv, 0)


# ------------------------------------------------------------------ per-mode backends

class SyncOutcome:
    __slots__ = ("counts",)

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts = counts or {}


class IptablesBackend:
    mode = "iptables"
    # hourly, as kube-proxy (FullSyncPeriod); every --sync-period a partial one. A full
    # restore takes seconds at scale (a minute on iptables-nft here at 10,000 x 15): every
    # --sync-period it made every sync a full one and a change waited for it
    full_every = "hour"

    def __init__(self, runner: CommandRunner, cfg: Config, family: int, *, applying: bool = True) -> None:
        self.cfg, self.family, self.applying = cfg, family, applying
        self.exe = IptablesExecutor(runner, family)
        self.large = False
        self.last_cleanup = -1e18
        self.previous = None      # the RuleSet in the kernel (without its text), for partial syncs
        self.warned = False       # the nf_tables backend notice, once
        # What the last full sync declared, for removing what other modes left (see Proxier)
        self.kept: dict[str, set[str]] | None = None
        self.wanted_jumps: set[tuple[str, str, str]] = set()
        from .iptables import RenderCache
        self.cache = RenderCache()   # per-service-port render work across syncs

    async def sync(self, state: ClusterState, changed: set | None, now: float) -> SyncOutcome:
        from . import iptables
        full = changed is None
        existing = None
        missing: list[tuple[str, str, str]] = []
        all_missing = True
        t0 = time.monotonic()
        # iptables-save is slow on big rule sets: in large clusters look for
        # stale chains at most once per sync period (kube-proxy does the same); on the
        # nf_tables backend only in full syncs: iptables-nft-save takes ~10 s at 10,000
        # Services, and a partial sync deletes the chains it stops using itself
        nft_large = self.large and self.exe.backend == "nft"
        if self.applying and (full or not self.large
                              or not nft_large and now - self.last_cleanup >= self.cfg.proxy.sync_period):
            save = "".join([await self.exe.save("nat"), await self.exe.save("filter")])
            # one light pass, in a thread: the dump is 300,000 lines at 10,000 Services
            kube, present = await asyncio.to_thread(iptsave.summary, save)
            del save
            existing = {t: c for t, c in kube.items() if t in ("nat", "filter")}
            self.last_cleanup = now
            if full:
                wanted = iptables.jump_rules(self.cfg, self.family)
                missing = [j for j in wanted if j not in present]
                all_missing = len(missing) == len(wanted)
        # The text inserts the jumps from the built-in chains only when none is
        # there yet; a few missing ones are put back one by one (iptables -C/-I style).
        # In a worker thread: a large render must not stall the event loop, which
        # answers DNS meanwhile (the render holds the GIL only between switches).
        # iptables-nft: the full text lists the nat table first (see apply.whole_table_cache)
        listing = full and self.applying and self.exe.backend == "nft" and self.exe.list_tables
        rs = await asyncio.to_thread(iptables.render, state, self.cfg, self.family, only=changed,
                                     existing=existing, jumps=full and all_missing,
                                     previous=None if full else self.previous, listing=listing,
                                     cache=self.cache)
        self.previous = None          # until the kernel is known to hold rs
        t1 = time.monotonic()
        if rs.text:
            await self.exe.restore(rs.text, full=full, listed=rs.listed)
        if full:
            log.debug("iptables IPv%d full sync: read and render %.3fs, %s %.3fs", self.family, t1 - t0,
                      self.exe.last_path, time.monotonic() - t1)
        # Partial syncs write only what changed against this (the text itself is not kept)
        self.previous = dataclasses.replace(rs, text="")
        if full and missing and not all_missing:
            for table, chain, spec in missing:
                await self.exe.insert(table, chain, spec)
        self.large = rs.large_cluster
        # (full texts go in over netlink where they can: the tool is only the fallback)
        if full and not self.warned and self.exe.backend == "nft" and self.exe.last_path != "netlink" \
                and len(rs.tops) >= NFT_BACKEND_WARN:
            self.warned = True
            log.warning(
                "iptables mode on the nf_tables backend (iptables-nft) with %d Services (IPv%d), full "
                "restores through iptables-nft-restore: each (start, each --sync-period, after a failure) "
                "takes seconds here, growing faster than the Services (iptables-nft looks chains up in a "
                "hash of 512 buckets; measured with 10 endpoints each: 1,000 ~1.7 s, 10,000 ~15-30 s). "
                "--proxy-mode nftables programs the same Services in a fraction of it.", len(rs.tops), self.family)
        if full:
            self.kept = {t: set(c) for t, c in rs.chains.items()}
            self.wanted_jumps = set(iptables.jump_rules(self.cfg, self.family))
        return SyncOutcome(dict(rs.counts))

    async def canary_ok(self) -> bool:
        return await self.exe.canary_exists()

    async def programmed_ports(self) -> set | None:
        """The ClusterIP ports a previous process left in the kernel, without their endpoints:
        on the nf_tables backend, KUBE-SERVICES alone over netlink (proxy/readback.py);
        None where there is no such reader (iptables-legacy, a runner not the kernel's)."""
        await self.exe.detect_backend(keep_dump=True)
        netns = netlink_netns(self.exe.runner)
        if self.exe.backend != "nft" or netns is False:
            return None
        from . import nflink, readback
        try:
            return await asyncio.to_thread(readback.iptables_nft_ports, self.family, netns)
        except nflink.NflinkError as exc:
            raise ApplyError(Result(("nfnetlink",), 1, "", str(exc))) from None

    async def programmed(self) -> dict:
        """(ClusterIP, protocol, port) -> "ip:port" endpoints a previous process left in
        the kernel, from one iptables-save (the one the backend choice made, when it
        did: every table; else `-t nat` and the small `-t filter`)."""
        await self.exe.detect_backend(keep_dump=True)
        dump = self.exe.take_detection_dump()   # the start just dumped every table
        nat = dump if dump is not None else await self.exe.save("nat")
        if "KUBE-SERVICES" not in nat:
            return {}
        filter_text = dump if dump is not None else await self.exe.save("filter")
        # ~0.5 s at 10,000 x 10: in a thread, so the source's list is not held up
        return await asyncio.to_thread(iptsave.programmed, nat, filter_text)


def release_free_memory() -> None:
    """malloc_trim(0): return the C heap's free pages to the system (glibc; elsewhere nothing)."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class NftablesBackend:
    mode = "nftables"
    # Periodic syncs only apply what changed; the whole table is rewritten
    # hourly, as kube-proxy does (a full transaction is costly at scale).
    full_every = "hour"

    def __init__(self, runner: CommandRunner, cfg: Config, family: int, *, applying: bool = True) -> None:
        self.cfg, self.family = cfg, family
        self.exe = NftExecutor(runner, family)
        self.previous = None   # NftState of the last applied transaction
        self.last_path = ""    # "nft" or "netlink": how the last transaction went in
        from .nftables import RenderCache
        self.cache = RenderCache()   # per-Service render work across full syncs

    async def sync(self, state: ClusterState, changed: set | None, now: float) -> SyncOutcome:
        from . import nftables
        if changed is None:
            # Full: recreate the table at start and after any trouble; otherwise
            # flush and refill it in place (affinity sets keep their entries).
            # (in a worker thread: seconds at scale, while the event loop answers DNS)
            rs = await asyncio.to_thread(nftables.render, state, self.cfg, self.family, previous=self.previous,
                                         resync=self.previous is not None, cache=self.cache)
        else:
            rs = nftables.render(state, self.cfg, self.family, previous=self.previous, changed=changed,
                                 cache=self.cache)
        if not rs.ops:
            self.previous = rs.state
            return SyncOutcome()
        try:
            if rs.full:
                self.last_path = await self.exe.apply_full(lambda: rs.text, rs.ops)
            else:
                self.last_path = await self.exe.apply_small(lambda: rs.text, rs.ops)
        except ApplyError:
            self.previous = None
            raise
        log.debug("nftables IPv%d: %s transaction of %d statements applied via %s", self.family,
                  "full" if rs.full else "incremental", rs.changes, self.last_path)
        self.previous = rs.state
        if rs.full:
            # the render's and the batch's transient memory back to the system (glibc keeps
            # freed heap pages otherwise: ~12 MB of RSS at 10,000 x 10); off the event loop
            del rs
            await asyncio.to_thread(release_free_memory)
        return SyncOutcome()

    def reset(self) -> None:
        self.previous = None

    async def programmed(self) -> dict:
        """(ClusterIP, protocol, port) -> "ip:port" endpoints a previous process left in the
        kernel, read over netlink from the service and endpoint maps (nftables.programmed)."""
        from . import nflink, nftables
        netns = self.exe.netlink_netns
        if netns is False:
            return {}   # a fake or wrapped runner: the kernel is not ours to read
        try:
            return await asyncio.to_thread(nftables.programmed, self.family, netns)
        except nflink.NflinkError as exc:
            raise ApplyError(Result(("nfnetlink",), 1, "", str(exc))) from None

    async def programmed_ports(self) -> set | None:
        """The ClusterIP ports in the kernel, without their endpoints: the service-ips
        elements alone (proxy/readback.py); None for a runner that is not the kernel's."""
        from . import nflink, readback
        netns = self.exe.netlink_netns
        if netns is False:
            return None
        try:
            return await asyncio.to_thread(readback.nftables_ports, self.family, netns)
        except nflink.NflinkError as exc:
            raise ApplyError(Result(("nfnetlink",), 1, "", str(exc))) from None

    async def canary_ok(self) -> bool:
        return await self.exe.table_exists()


class IpvsBackend:
    mode = "ipvs"
    full_every = "sync_period"

    def __init__(self, runner: CommandRunner, cfg: Config, family: int, *, applying: bool = True) -> None:
        self.cfg, self.family = cfg, family
        self.exe = IpvsExecutor(runner, family)
        self.kept: dict[str, set[str]] | None = None
        self.wanted_jumps: set[tuple[str, str, str]] = set()
        from .servicemap import PortsCache
        self.cache = PortsCache()   # servicemap's work across syncs

    async def sync(self, state: ClusterState, changed: set | None, now: float) -> SyncOutcome:
        from . import ipvs
        config = await asyncio.to_thread(ipvs.render, state, self.cfg, self.family, cache=self.cache)
        await self.exe.apply(config, self.cfg.proxy.ipvs_exclude_cidrs)
        # what every IPVS iptables text declares and inserts (fixed; no need to read it back)
        self.kept = {t: set(chains) for t, chains in ipvs.CHAINS.items()}
        self.wanted_jumps = set(ipvs.JUMP_RULES)
        return SyncOutcome()

    async def programmed(self) -> dict:
        """The virtual servers and their real servers now in the kernel (`ipvsadm -Ln`)."""
        from . import ipvs
        res = await self.exe.runner.run(["ipvsadm", "-L", "-n"])
        if res.returncode != 0:
            return {}
        return ipvs.parse_list(res.stdout, self.family)

    async def canary_ok(self) -> bool:
        return True


BACKENDS = {"iptables": IptablesBackend, "nftables": NftablesBackend, "ipvs": IpvsBackend}


# ------------------------------------------------------------------ the proxier

class Proxier:
    """Programs the kernel from the StateStore; see the module docstring.

    executor: the CommandRunner every tool runs through (default: real
    subprocesses when applying, a printer for --dry-run / the demo).
    family: program only this family (default: the families of --node-ip)."""

    def __init__(self, cfg: Config, store: StateStore, *, executor: CommandRunner | None = None,
                 family: int | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], "asyncio.Future"] = asyncio.sleep,
                 out: TextIO | None = None, health_host: str | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.monotonic = monotonic
        self.applying = cfg.applying
        runner = executor or (SubprocessRunner() if self.applying else PrintingRunner(out))
        self._tool_runner = runner
        self.families = [family] if family else node_families(cfg)
        self.backends = {}
        if cfg.proxy.proxy_mode in BACKENDS:
            self.backends = {f: BACKENDS[cfg.proxy.proxy_mode](runner, cfg, f, applying=self.applying)
                             for f in self.families}
        self.conntrack = ({f: ConntrackCleaner(runner, f) for f in self.families}
                          if self.applying and self.backends else {})
        self.health = ProxierHealth(2 * cfg.proxy.sync_period, clock)
        self.service_health = ServiceHealthServers(health_host) if self.applying and self.backends else None
        self._local_counts: dict | None = None    # local_endpoint_counts as of the last sync
        self.applied_version = 0
        self.applied_state = ClusterState()
        self.syncs = 0
        self.failures = 0
        self.last_error: str = ""
        self._listeners: list[Callable[[int], None]] = []
        self._pending: set[tuple[str, str]] = set()
        self._pending_endpoints = 0
        self._pending_services = 0
        self._triggers: dict[tuple[str, str], list[float]] = {}
        self._need_full = True
        self._last_full = -1e18
        self._last_canary = monotonic()
        self._last_reconcile = -1e18
        self._leftovers_checked = False
        self._leftovers: asyncio.Task | None = None
        # syncs and the leftovers' removal write the same tables: one at a time
        self._apply_lock = asyncio.Lock()
        self._no_local: dict[tuple[str, str], tuple[int, int]] = {}
        self._synced_event = asyncio.Event()
        self._runner = BoundedFrequencyRunner("sync-proxy-rules", self._sync, cfg.proxy.min_sync_period,
                                              cfg.proxy.sync_period, burst=2, clock=monotonic, sleep=sleep)
        store.subscribe(self._on_change)
        if store.current.is_synced("Service", "EndpointSlice"):
            self._pending |= set(store.current.services)
            self.health.queued_update()

    # -- public API
    def detach(self) -> None:
        """Stop following the store (a proxier being replaced)."""
        self.store.unsubscribe(self._on_change)

    def add_listener(self, fn: Callable[[int], None]) -> None:
        """fn(version) runs after each successful sync with the state version now in the kernel."""
        self._listeners.append(fn)

    def request_sync(self) -> None:
        LAST_QUEUED.set(self.clock())
        self.health.queued_update()
        self._runner.run()

    async def run(self) -> None:
        """Sync until stop(). The first sync runs as soon as the state is synced."""
        if self.applying and self.backends:
            # kube-proxy's start-up host settings (conntrack sysctls...), before any rule;
            # a SysctlError ends the proxier, as it ends kube-proxy
            from .sysctl import host_setup
            host_setup(self.cfg)
        if self.store.current.is_synced("Service", "EndpointSlice"):
            self._runner.run()
        try:
            await self._runner.loop()
        finally:
            if self._leftovers is not None and not self._leftovers.done():
                self._leftovers.cancel()
                await asyncio.gather(self._leftovers, return_exceptions=True)
            if self.service_health:
                await self.service_health.close()

    async def stop(self) -> None:
        self._runner.stop()

    async def programmed(self) -> dict:
        """What a previous process left in the kernel in this mode, every family merged:
        (ClusterIP, protocol, port) -> frozenset of "ip:port" endpoints (see
        clusterdns.dnsview). Empty when not applying, or when a backend cannot
        tell (one without a `programmed()` reader answers nothing)."""
        if not self.applying:
            return {}
        out: dict = {}
        for fam, backend in self.backends.items():
            reader = getattr(backend, "programmed", None)
            if reader is None:
                continue
            try:
                found = reader()
                if inspect.isawaitable(found):
                    found = await found
            except (ApplyError, OSError, ValueError) as exc:
                log.warning("cannot read the %s rules in the kernel (IPv%d): %s", backend.mode, fam, exc)
                continue
            out.update(found or {})
        return out

    async def programmed_ports(self) -> dict | None:
        """The cheap first half of programmed(): (ClusterIP, protocol, port) -> None (endpoints
        not read) for every port whose rules a previous process left in the kernel, each
        backend reading only its per-port entry points (proxy/readback.py). None when a
        backend has no such reader or it failed: programmed() is then the only way."""
        if not self.applying:
            return {}
        out: dict = {}
        for fam, backend in self.backends.items():
            reader = getattr(backend, "programmed_ports", None)
            if reader is None:
                return None
            try:
                found = await reader()
            except (ApplyError, OSError, ValueError) as exc:
                log.warning("cannot read the %s rules in the kernel (IPv%d): %s", backend.mode, fam, exc)
                return None
            if found is None:
                return None
            out.update(dict.fromkeys(found))
        return out

    async def wait_synced(self, version: int = 0, timeout: float | None = None) -> bool:
        """Wait until rules for `version` (or any version) are in; False on timeout."""
        async def _wait():
            while self.syncs == 0 or self.applied_version < version:
                self._synced_event.clear()
                await self._synced_event.wait()
            if self._leftovers is not None:
                await asyncio.shield(self._leftovers)
        try:
            await asyncio.wait_for(_wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- state changes
    def _on_change(self, old: ClusterState, new: ClusterState, delta: Delta) -> None:
        for key in delta.services:
            if old.services.get(key) != new.services.get(key):
                SERVICE_CHANGES.inc()
                self._pending_services += 1
            else:
                ENDPOINT_CHANGES.inc()
                self._pending_endpoints += 1
            if "EndpointSlice" in delta.kinds:
                for sl in new.slices_for(*key):
                    if sl.trigger_time and old.slices.get(sl.key) != sl:
                        self._triggers.setdefault(key, []).append(sl.trigger_time)
        SERVICE_CHANGES_PENDING.set(self._pending_services)
        ENDPOINT_CHANGES_PENDING.set(self._pending_endpoints)
        self._pending |= delta.services
        if "Node" in delta.kinds:
            self._need_full = True   # node labels decide topology: rebuild everything
        became_synced = new.is_synced("Service", "EndpointSlice") and not old.is_synced("Service", "EndpointSlice")
        if delta.services or "Node" in delta.kinds or became_synced:
            self.request_sync()

    # -- one sync
    async def _sync(self) -> None:
        state = self.store.current
        if not state.is_synced("Service", "EndpointSlice"):
            log.debug("not syncing: Services and EndpointSlices not listed yet")
            return
        now = self.monotonic()
        if not self.applying and self.syncs and not self._pending and not self._need_full:
            # Dry run: no kernel to repair, so a periodic sync would only reprint the same text.
            self.health.updated()
            return
        changed, self._pending = self._pending, set()
        triggers, self._triggers = self._triggers, {}
        period = FULL_SYNC_PERIOD
        if any(b.full_every == "sync_period" for b in self.backends.values()):
            period = min(period, self.cfg.proxy.sync_period * 0.999)
        full = self._need_full or now - self._last_full >= period
        if not full and self.applying and now - self._last_canary >= self.cfg.proxy.sync_period / 2:
            self._last_canary = now
            for fam, backend in self.backends.items():
                if not await backend.canary_ok():
                    log.warning("%s canary missing (IPv%d): tables were flushed; full sync",
                                backend.__class__.mode, fam)
                    full = True
                    for b in self.backends.values():
                        getattr(b, "reset", lambda: None)()
                    break
        start = time.perf_counter()
        outcomes = {}
        try:
            async with self._apply_lock:
                for fam, backend in self.backends.items():
                    outcomes[fam] = await backend.sync(state, None if full else changed, now)
        except ApplyError as exc:
            self.failures += 1
            self.last_error = str(exc)
            RESTORE_FAILURES.inc()
            if not full:
                PARTIAL_FAILURES.inc()
            log.error("%s sync failed, keeping the previous rules: %s", "full" if full else "partial", exc)
            self._pending |= changed
            for k, v in triggers.items():
                self._triggers.setdefault(k, []).extend(v)
            self._need_full = True
            self._runner.retry_after(self.cfg.proxy.sync_period)
            return
        elapsed = time.perf_counter() - start
        SYNC_DURATION.observe(elapsed)
        (SYNC_FULL_DURATION if full else SYNC_PARTIAL_DURATION).observe(elapsed)
        if full:
            self._need_full = False
            self._last_full = now
            self._last_canary = now
        previous, self.applied_state = self.applied_state, state
        self.applied_version = state.version
        self.syncs += 1
        self._pending_services = self._pending_endpoints = 0
        SERVICE_CHANGES_PENDING.set(0)
        ENDPOINT_CHANGES_PENDING.set(0)
        wall = self.clock()
        LAST_SYNC.set(wall)
        for times in triggers.values():
            for t in times:
                if wall >= t:
                    NETWORK_PROGRAMMING.observe(wall - t)
        self._record_counts(outcomes, full)
        self._update_no_local(state, None if full else changed)
        self.health.updated()
        if self._pending:   # changes that arrived during this sync wait for the next one
            self.health.queued_update()
        log.debug("%s sync of state version %d took %.3fs (%d changed services)",
                  "full" if full else "partial", state.version, elapsed, len(changed))
        # The rules are in: DNS may show them now, before the conntrack and health-check work
        # below (a reconcile parses every UDP flow: tens of milliseconds at scale)
        for fn in list(self._listeners):
            try:
                fn(state.version)
            except Exception:
                log.exception("sync listener failed")
        # Conntrack: reconcile the UDP flows in the kernel with what was just programmed
        # after the first sync (changes made while no agent ran), full syncs, and at least
        # every sync period; in between, the flows the changed Services left.
        reconcile = self.syncs == 1 or full or now - self._last_reconcile >= self.cfg.proxy.sync_period
        if reconcile:
            self._last_reconcile = now
        for fam, cleaner in self.conntrack.items():
            if reconcile:
                await cleaner.reconcile(state, self.cfg.proxy.service_cidrs)
                continue
            flows = stale_flows(previous, state, fam, keys=changed)
            if flows:
                await cleaner.clear(flows)
        if self.service_health:
            node = self.cfg.proxy.node_name
            if full or self._local_counts is None:
                self._local_counts = local_endpoint_counts(state, node)
            else:   # only the changed Services: the whole pass is milliseconds at 10,000
                for key in changed:
                    self._local_counts.pop(key, None)
                self._local_counts.update(local_endpoint_counts(state, node, keys=changed))
            await self.service_health.sync(self._local_counts)
        if full and self.applying and not self._leftovers_checked:
            # Beside the next syncs, not before them: at 10,000 Services on iptables-nft, a dump
            # of every table and its parse take ~9 s, which the first change waited for;
            # wait_synced() still waits for it.
            self._leftovers_checked = True
            self._leftovers = asyncio.create_task(self._remove_other_modes())
        self._synced_event.set()

    async def _remove_other_modes(self) -> list[str]:
        """After the first full sync: remove what clusterdns (or kube-proxy, same names) left
        in the other modes, so that switching modes needs no reboot and leaves no stale
        DNAT. Done after our rules are in, so traffic never goes without rules. Failures
        are logged; the rules just applied stand."""
        from . import iptables
        mode = self.cfg.proxy.proxy_mode
        removed: list[str] = []
        if not self.backends:    # --proxy-mode none: another proxier may own the rules
            return removed
        runner = self._tool_runner
        try:
            for fam, backend in self.backends.items():
                own = getattr(backend, "exe", None)
                own_ipt = own if isinstance(own, IptablesExecutor) else getattr(own, "iptables", None)
                own_name = own_ipt.backend if own_ipt is not None else None
                for name in ("nft", "legacy"):
                    exe = IptablesExecutor(runner, fam, name)
                    if isinstance(runner, SubprocessRunner) and not _have(exe.tool("save")):
                        continue
                    try:
                        save = await exe.save_all()
                    except ApplyError as exc:
                        log.debug("cannot read %s: %s", exe.tool("save"), exc)
                        continue
                    # (parsed in a thread: our own dump is 300,000 lines at 10,000 Services)
                    own_tables = name == own_name and getattr(backend, "kept", None) is not None
                    if own_tables:
                        # our own tables: only the chains and jumps our full sync did not write
                        text = await asyncio.to_thread(iptables.foreign_cleanup_text, save, backend.kept,
                                                       backend.wanted_jumps)
                    else:
                        text = await asyncio.to_thread(iptables.cleanup_saved, save)
                    del save
                    async with self._apply_lock:
                        if own_tables and getattr(backend, "previous", None) is not None:
                            # syncs since the dump may have made chains it did not hold
                            text = _sparing(text, backend.previous.chains)
                        if text.strip():
                            await exe.restore(text, full=True)
                        removed.append(f"iptables-{name} IPv{fam}" + (" (other modes' chains)"
                                                                       if name == own_name else ""))
                if mode != "nftables":
                    nft = NftExecutor(runner, fam)
                    if await nft.table_listed():
                        from . import nftables
                        async with self._apply_lock:
                            await nft.apply(nftables.cleanup_text(fam))
                        removed.append(f"nftables IPv{fam}")
            if mode != "ipvs":
                res = await runner.run(["ip", "link", "show", "kube-ipvs0"])
                if res.returncode == 0:
                    async with self._apply_lock:
                        await IpvsExecutor(runner, 4).clear()
                    removed.append("ipvs")
        except (ApplyError, OSError) as exc:
            log.warning("removing what other proxy modes left failed: %s", exc)
        if removed:
            log.info("%s mode: removed what other modes left: %s", mode, ", ".join(removed))
        return removed

    def _record_counts(self, outcomes: dict, full: bool) -> None:
        totals: dict[str, int] = {}
        for outcome in outcomes.values():
            for table, n in outcome.counts.items():
                totals[table] = totals.get(table, 0) + n
        for table, n in totals.items():
            IPTABLES_LAST.labels(table).set(n)
            if full:
                IPTABLES_TOTAL.labels(table).set(n)

    def _update_no_local(self, state: ClusterState, changed: set | None) -> None:
        """Services with a Local policy whose endpoints are all on other nodes."""
        keys = state.services.keys() if changed is None else changed
        if changed is None:
            self._no_local = {}
        for key in keys:
            svc = state.services.get(key)
            self._no_local.pop(key, None)
            if svc is None or not (svc.internal_local or svc.external_local) or svc.headless:
                continue
            any_ep = local = False
            for sl in state.slices_for(*key):
                for ep in sl.endpoints:
                    if ep.ready or (ep.serving and ep.terminating):
                        any_ep = True
                        local = local or ep.node_name == self.cfg.proxy.node_name
            if any_ep and not local:
                external = svc.external_local and bool(
                    svc.external_ips or svc.lb_ips or any(p.node_port for p in svc.ports))
                self._no_local[key] = (int(svc.internal_local), int(external))
        NO_LOCAL_ENDPOINTS.labels("internal").set(sum(v[0] for v in self._no_local.values()))
        NO_LOCAL_ENDPOINTS.labels("external").set(sum(v[1] for v in self._no_local.values()))


def _sparing(text: str, chains: dict[str, frozenset[str]]) -> str:
    """A cleanup text without the lines removing `chains` (table -> chains now in use)."""
    out = []
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":"):
            if line[1:].split(" ", 1)[0] in chains.get(table, ()):
                continue
        elif line.startswith("-X ") and line[3:].strip() in chains.get(table, ()):
            continue
        out.append(line)
    return "\n".join(out) + "\n" if out else ""


# ------------------------------------------------------------------ cleanup

async def cleanup(cfg: Config, runner: CommandRunner | None = None) -> list[str]:
    """Remove every rule, chain, table, set and device clusterdns may have installed,
    in all modes and both families, touching nothing else. Returns what was removed."""
    from . import iptables
    runner = runner or SubprocessRunner()
    done: list[str] = []
    for family in (4, 6):
        for backend in ("nft", "legacy"):
            exe = IptablesExecutor(runner, family, backend)
            if not isinstance(runner, SubprocessRunner) or _have(exe.tool("save")):
                try:
                    save = await exe.save_all()
                except ApplyError as exc:
                    log.debug("cannot read %s: %s", exe.tool("save"), exc)
                    continue
                text = iptables.cleanup_saved(save)   # nothing when only the kubelet's chains are there
                if text.strip():
                    await exe.restore(text, full=True)
                    done.append(f"iptables-{backend} IPv{family}")
        nft = NftExecutor(runner, family)
        if await nft.table_listed():
            from . import nftables
            await nft.apply(nftables.cleanup_text(family))
            done.append(f"nftables IPv{family}")
    ipvs = IpvsExecutor(runner, 4)
    res = await runner.run(["ip", "link", "show", "kube-ipvs0"])
    if res.returncode == 0:
        await ipvs.clear()
        done.append("ipvs")
    # The agent's --local-ip device and NOTRACK/ACCEPT chains are ours too.
    from .. import localdns
    done += await localdns.cleanup(runner)
    return done


def _have(tool: str) -> bool:
    import shutil
    return shutil.which(tool) is not None


__all__ = ["Proxier", "PrintingRunner", "cleanup", "node_families"]
