"""The node agent: one watched state feeding the DNS server and the proxier.

DNS reads a DnsView (clusterdns/dnsview.py), not the store: a Service that
needs rules shows in DNS only once its rules are in the kernel. At start the
proxier reads what a previous process left in the kernel and the view adopts
it, so a restart answers the Services whose rules are still there at once;
DNS starts listening when that is known (see Agent.start).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

from prometheus_client import Counter

from . import handover
from .config import Config, load
from .dns.metrics import plugins_for
from .dnsview import DNS_PROGRAMMING, DnsView, needs_rules
from .errors import InputError
from .health import HealthServer, plan
from .localdns import LocalDNS, LocalDNSError
from .localdns import cleanup as localdns_cleanup
from .metrics import REGISTRY
from .model import KINDS
from .proxy.proxier import Proxier
from .sources.loader import make_source
from .state import StateStore

log = logging.getLogger(__name__)

RELOADS = Counter("clusterdns_config_reloads_total",
                  "Configuration reloads by result (applied, unchanged, failed).",
                  ["result"], registry=REGISTRY)

# ---------------------------------------------------------------- the agent

# How long a start whose kernel holds a previous process's rules waits, at most,
# for the Services to be listed before DNS listens anyway (the previous process,
# in lameduck, keeps answering meanwhile; see Agent.start).
DNS_START_WAIT = 30.0
# How long, at most, a restarted agent waits for its first rule sync before DNS listens
# while another process (the previous agent, in lameduck or not yet stopped) still
# answers on the same DNS addresses.
DNS_HANDOVER_WAIT = 120.0
# At most this long without garbage collections between DNS start and the first sync.
GC_PAUSE_LIMIT = 120.0
_UNREAD = object()   # the kernel's ports not read yet (Agent._run_proxier)
# Health starts before DNS when DNS has not started this long after the source and proxier.
HEALTH_FIRST_AFTER = 0.3


def changed_options(old: Config, new: Config) -> set[str]:
    """The options (flag names) whose values differ."""
    a, b = old.options(), new.options()
    return {name for name in a if a[name] != b[name]}


def health_roles(cfg: Config) -> tuple[str, ...]:
    return ("dns",) if cfg.proxy.proxy_mode == "none" else ("dns", "proxy")


def component_inputs(cfg: Config) -> dict[str, object]:
    """What each component the agent restarts on a reload is built from: its section,
    plus the few values it takes from another one, named here. The agent section's other
    options (lameduck, log level, loop) need no restart, nor does `run` (one-shot commands)."""
    from .sources.kube import resources_for  # + the kinds watched (dns.pods, dns.autopath, proxy.node_name)
    return {
        "source": (cfg.source, tuple(resources_for(cfg))),
        "proxy": (cfg.proxy, cfg.applying),
        "localdns": (cfg.dns.local_ips, cfg.applying),
        # + coredns_plugin_enabled names health, prometheus, reload from the agent section
        "dns": (cfg.dns, tuple(cfg.listen_addresses()), plugins_for(cfg, None)),
        "health": tuple(plan(cfg, health_roles(cfg))),   # agent's listeners; /proxyMode
    }


def restarts(old: Config, new: Config) -> set[str]:
    """The components a reload from `old` to `new` restarts."""
    a, b = component_inputs(old), component_inputs(new)
    return {name for name in a if a[name] != b[name]}


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
        self.corefile = None
        if cfg.dns.corefile:
            from .corefile.build import prepare  # CorefileError: exit 2 with FILE:LINE
            self.corefile, cfg = prepare(cfg, os.environ.get("KUBE_DNS_SERVICE_HOST"))
        self.cfg = cfg
        self.argv = argv
        self.executor = executor
        self.forwarder = forwarder
        self.localdns_runner = localdns_runner
        self.store = StateStore()
        self.view = DnsView(self.store, follow=cfg.proxy.proxy_mode == "none")
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
        self._adoption_read = asyncio.Event()
        # The first sync starts once DNS listens, or waits for that sync (see start): its render
        # would share the interpreter with the DNS start it would delay
        self._sync_may_start = asyncio.Event()
        self._gc_frozen = False
        self._gc_paused = False   # collections off from DNS start to the first sync (adoption)

    # -- readiness
    def not_ready(self) -> list[str]:
        return self.health.not_ready() if self.health else ["starting"]

    def _add_ready_checks(self, health) -> None:
        for kind in KINDS:
            health.add_ready_check(f"{kind} not synced", lambda k=kind: k in self.store.current.synced)
        health.add_ready_check("first rule sync not done",
                               lambda: self.proxier is None or self.proxier.syncs > 0)
        health.add_ready_check("dns", lambda: self.dns is not None and self.dns.synced)
        # The kube source's liveness probe: the state served is frozen while it fails.
        health.add_ready_check("kube API not answering", lambda: getattr(self.source, "api_ok", True))
        # a manifest file refused (emptied, lost most objects) or broken: the last good content is served
        health.add_ready_check("manifest not loaded (see log)",
                               lambda: not getattr(self.source, "problems", list)())

    # -- building blocks
    def _make_proxier(self):
        if self.cfg.proxy.proxy_mode == "none":
            return None
        proxier = Proxier(self.cfg, self.store, executor=self.executor)
        proxier.add_listener(self._on_rules_applied)
        return proxier

    def _on_rules_applied(self, version: int) -> None:
        self.view.applied(version)
        if not self._gc_frozen:
            # The state, zone and render caches built so far live long: keep the collector
            # from rescanning them (a full collection of millions of objects stalls DNS for
            # hundreds of milliseconds at 10,000 Services). New objects are collected as usual.
            self._gc_frozen = True
            gc.freeze()
            self._resume_gc()
        # A proxier full sync may insert its jumps above ours: re-check soon after.
        if self.localdns is not None and self.clock() - self._last_local_check > 5.0:
            self._last_local_check = self.clock()
            self._spawn("localdns-check", self._check_localdns())

    def _pause_gc(self) -> None:
        """With rules adopted from the kernel, DNS answers (soon) while the state is still
        being built and the first full render may run: no collections until that sync is in
        (at 10,000 Services each one scanned millions of objects, 0.1-0.7 s holding the GIL,
        and found no garbage); the first sync freezes what was built and collections resume.
        Bounded, should it never come."""
        if self.view.adopting and gc.isenabled():
            gc.freeze()
            gc.disable()
            self._gc_paused = True
            asyncio.get_running_loop().call_later(GC_PAUSE_LIMIT, self._resume_gc)

    def _resume_gc(self) -> None:
        if self._gc_paused:
            self._gc_paused = False
            gc.enable()

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

    async def _replace_dns(self) -> None:
        """Start DNS; on a reload, bind the new listeners before closing the old ones: an
        address that cannot be bound raises and leaves the running server as it was."""
        from .dns.server import DnsService
        kwargs = {} if self.forwarder is None else {"forwarder": self.forwarder}
        new = DnsService(self.cfg, self.view, reuse_port=True, corefile=self.corefile, **kwargs)
        try:
            await new.start()
        except BaseException:
            new.detach()
            raise
        old, self.dns = self.dns, new
        if old is not None:
            await old.stop()
            old.detach()

    async def _stop_dns(self) -> None:
        if self.dns is None:
            return
        await self.dns.stop()
        self.dns.detach()
        self.dns = None

    async def _start_localdns(self) -> None:
        if not self.cfg.dns.local_ips:
            return
        if not self.cfg.applying:
            log.warning("--local-ip given but not applying (--dry-run or demo): "
                        "the addresses must already exist on this host")
            return
        self.localdns = LocalDNS(self.cfg.dns.local_ips, self.localdns_runner)
        await self.localdns.setup()
        self._spawn("localdns", self.localdns.run())

    async def _start_health(self) -> None:
        from aiohttp import web

        from .proxy.healthcheck import aiohttp_handler
        health = HealthServer(self.cfg, roles=health_roles(self.cfg), reuse_port=True)
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

    def _start_source(self, strict: bool = True) -> None:
        # strict at start (a broken manifest is exit 2); not on reload, where a path that
        # does not exist yet must not end the source: it keeps polling, the last state stays.
        # With rules adopted from the kernel, the Services are listed first: DNS answers them then.
        self.source = make_source(self.cfg, self.store, strict=strict,
                                  first=("Service",) if self.view.adopting else ())
        self._spawn("source", self.source.run())

    def _start_proxier(self) -> None:
        self.proxier = self._make_proxier()
        if self.proxier is not None:
            self._spawn("proxier", self._run_proxier(self.proxier))
        else:
            self._adoption_read.set()

    async def _read_kernel_ports(self, proxier: Proxier) -> dict | None:
        """Restart adoption's first step: the ClusterIP ports whose rules a previous process
        left in the kernel, without their endpoints (tens of milliseconds), adopted by the
        view. None when a backend has no such reader; {} when there is nothing to read."""
        if self.view.applied_version >= 0 or self.view.adopting:
            return {}
        ports = await proxier.programmed_ports()
        if ports:
            self.view.adopt(ports, proxier.families)
        return ports

    async def _run_proxier(self, proxier: Proxier, ports: dict | None | object = _UNREAD) -> None:
        """Before the first sync, read what a previous process left in the kernel and let
        DNS count it as applied (restart adoption); then sync as usual.

        Where every backend can, only the ports are read (ports, when start() read them
        already): their endpoints come with the first sync. Reading them too costs seconds
        of CPU at 10,000 Services, by which the first sync, which brings them and every
        change made while no agent ran, would come later. Elsewhere (IPVS, iptables-legacy)
        the whole read, as before."""
        try:
            if ports is _UNREAD:
                ports = await self._read_kernel_ports(proxier)
            if ports is None and self.view.applied_version < 0 and not self.view.adopting:
                found = await proxier.programmed()
                if found:
                    self.view.adopt(found, proxier.families)
                del found   # this coroutine lives as long as the proxier (~15 MB at 10,000 Services)
            del ports
        finally:
            self._adoption_read.set()
        await self._sync_may_start.wait()
        await proxier.run()

    async def _wait_for_dns_start(self, limit: float = DNS_START_WAIT) -> None:
        """Listen for DNS only once the answers can be right, when that is close.

        Cold node (nothing adopted from the kernel): at once, as before (names
        answer SERVFAIL until the first sync; forwarding works). A restart with
        rules in the kernel: once the Services are listed and adopted, or the
        first sync is done, or after `limit` seconds. The previous process keeps
        answering meanwhile: DNS sockets use SO_REUSEPORT, so the two share the
        port during its lameduck, and the new one never answers SERVFAIL for a
        Service whose rules work."""
        if self.proxier is None:
            return
        end = time.monotonic() + limit
        try:
            await asyncio.wait_for(self._adoption_read.wait(), limit)
        except asyncio.TimeoutError:
            return
        if not self.view.adopting:
            return
        if self._predecessor_answers():
            # Another process answers on our addresses: let it, until this one has nothing
            # heavy left to do (the first full render and load hold the GIL for long
            # stretches, and half the queries would come here once we listen).
            log.info("another process answers on %s: DNS listens after the first rule sync",
                     ", ".join(f"{h}:{p}" for h, p in self.cfg.listen_addresses()))
            self._sync_may_start.set()     # DNS waits for that sync
            hand_end = time.monotonic() + DNS_HANDOVER_WAIT
            while self.view.applied_version < 0:
                if not self._predecessor_answers():
                    log.info("the other process stopped answering; DNS listens now")
                    break
                if time.monotonic() >= hand_end:
                    log.warning("first rule sync not done %gs after start; DNS listens anyway",
                                DNS_HANDOVER_WAIT)
                    return
                await asyncio.sleep(0.05)
            if self.view.applied_version >= 0:
                return
        while time.monotonic() < end:
            # The Services alone: a ClusterIP answer needs no EndpointSlice (headless names
            # answer SERVFAIL, try again, until theirs are listed too)
            if self.store.current.is_synced("Service") or self.view.applied_version >= 0:
                return
            await asyncio.sleep(0.005)
        log.warning("Services not listed %gs after start; DNS listens anyway", limit)

    def _predecessor_answers(self) -> bool:
        addrs = self.cfg.listen_addresses()
        if any(port == 0 for _, port in addrs):
            return False
        return handover.others_on(addrs)

    def _successor_listens(self) -> bool:
        """Another process has bound every one of our DNS addresses (UDP)."""
        if self.dns is None or not self.dns.bound:
            return True
        ours = {handover.inode(s) for s in self.dns.udp_sockets()}
        return handover.others_on(self.dns.bound, ours)

    async def _stop_proxier(self) -> None:
        if self.proxier is None:
            return
        await self.proxier.stop()
        task = self._tasks.pop("proxier", None)
        if task is not None:
            task.cancel()
            await _quiet(task)
        self.proxier.detach()
        self.proxier = None

    # -- lifecycle
    async def start(self) -> None:
        """Everything up; raises UsageError (bad input) or OSError (an address in use)."""
        self._stopping = asyncio.Event()
        self._config_stamp = _stamp(self.cfg.agent.config_file)
        # What the kernel holds first: the Services then count as adopted as the source
        # brings them (one pass over them instead of two; the read is tens of milliseconds).
        self.proxier = self._make_proxier()
        ports: dict | None = await self._read_kernel_ports(self.proxier) if self.proxier is not None else {}
        self._pause_gc()              # the Services are answered as soon as they are read
        self._start_source()          # a broken manifest raises here
        if self.proxier is not None:
            self._spawn("proxier", self._run_proxier(self.proxier, ports))
        else:
            self._adoption_read.set()
        await self._start_localdns()  # before DNS: it listens on these addresses
        # Health listens before DNS when DNS waits (probes answered, /ready 503 meanwhile),
        # else right after it: its import (aiohttp) is then not on the way to the first answer.
        early = asyncio.get_running_loop().call_later(
            HEALTH_FIRST_AFTER, lambda: self._spawn("health-start", self._start_health()))
        try:
            await self._wait_for_dns_start()
        finally:
            early.cancel()
        self._pause_gc()
        try:
            await self._replace_dns()
        finally:
            self._sync_may_start.set()
        log.info("DNS listens%s", f" ({self.view.adopted} Services answered from the kernel's rules until "
                                  "the first sync)" if self.view.adopting else "")
        health = self._tasks.pop("health-start", None)
        if health is not None:
            await health
        else:
            await self._start_health()
        if self.cfg.agent.config_file:
            self._spawn("config-watch", self._watch_config())
        if self.corefile is not None and self.corefile.reload is not None:
            from .corefile.reloader import Reloader
            self._spawn("corefile-reload", Reloader(self.cfg, self.corefile, self._serve_corefile,
                                                    os.environ.get("KUBE_DNS_SERVICE_HOST")).run())

    async def _serve_corefile(self, corefile) -> None:
        """The reload plugin found a changed Corefile: serve it (new listeners bound first)."""
        old = self.corefile
        self.corefile = corefile
        try:
            await self._replace_dns()
        except BaseException:
            self.corefile = old
            raise

    def banner(self) -> str:
        from .dns.server import banner
        text = banner(self.dns).replace("clusterdns dns", "clusterdns agent", 1)
        mode = self.cfg.proxy.proxy_mode if self.proxier else "none"
        text += f"; proxier: {mode} ({'applying' if self.cfg.applying else 'printing'})"
        if self.health:
            for kind, label in (("health", "health/ready"), ("metrics", "DNS metrics"),
                                ("proxy-metrics", "proxy metrics")):
                if self.health.bound_kinds.get(kind):
                    text += f"; {label} on " + ", ".join(f"{h}:{p}" for h, p in self.health.bound_kinds[kind])
        if self.cfg.source.demo:
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
        if not code and self.cfg.agent.lameduck > 0:
            log.info("shutting down: lameduck for %gs (still answering, /ready 503)", self.cfg.agent.lameduck)
            self.health.lameduck = True
            t0 = time.monotonic()
            if self.proxier is not None:
                # The rules stay as they are; the successor (started meanwhile) programs the
                # same table: two writers would undo each other's partial syncs.
                await self.proxier.stop()
            await asyncio.sleep(self.cfg.agent.lameduck)
            await self._hand_over(t0 + self.cfg.agent.lameduck_handover)
        waiter.cancel()
        await self.stop()
        return code

    async def _hand_over(self, until: float) -> None:
        """Go on answering until a successor listens on our DNS addresses (or `until`):
        with SO_REUSEPORT it shares them, so no query goes unanswered between the two."""
        if any(port == 0 for _, port in self.cfg.listen_addresses()):
            return   # a port picked at bind time: no successor can share it
        if time.monotonic() >= until or self._successor_listens():
            return
        log.info("lameduck: answering until another process listens on the DNS addresses "
                 "(at most %gs more)", until - time.monotonic())
        while time.monotonic() < until:
            if self._successor_listens():
                log.info("another process listens on the DNS addresses; stopping")
                return
            await asyncio.sleep(0.05)
        log.info("no other process listens on the DNS addresses; stopping anyway")

    async def stop(self) -> None:
        """Stop serving. Rules and local addresses stay in the kernel, as kube-proxy's and
        NodeLocal DNSCache's do across restarts; `clusterdns proxy --cleanup` removes them."""
        self._resume_gc()
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
            stamp = _stamp(self.cfg.agent.config_file)
            if stamp != self._config_stamp:
                self._config_stamp = stamp
                log.info("%s changed; reloading the configuration", self.cfg.agent.config_file)
                await self.reload()

    async def reload(self) -> bool:
        """Re-read the command line and --config file; restart what changed.

        A bad configuration is reported and the running one kept (False)."""
        if self.argv is None:
            log.warning("reload: the command line is unknown; nothing to re-read")
            return False
        try:
            new = load(self.argv)
            corefile = self.corefile
            if new.dns.corefile:
                from .corefile.build import prepare
                corefile, new = prepare(new, os.environ.get("KUBE_DNS_SERVICE_HOST"))
        except InputError as exc:
            self.reload_errors += 1
            RELOADS.labels("failed").inc()
            log.error("reload failed, keeping the running configuration: %s", exc)
            return False
        changed = changed_options(self.cfg, new)
        restart = restarts(self.cfg, new)
        if (corefile is None) != (self.corefile is None) or (
                corefile is not None and corefile.digest != self.corefile.digest):   # type: ignore[union-attr]
            restart.add("dns")
            changed.add("corefile")
        self.corefile = corefile
        old, self.cfg = self.cfg, new
        if new.agent.log_level != old.agent.log_level:
            logging.getLogger().setLevel(new.agent.log_level.upper())
        if not restart:
            log.info("reload: %s", "changed " + ", ".join(sorted(changed)) + "; nothing to restart"
                     if changed else "configuration unchanged")
            RELOADS.labels("unchanged").inc()
            return True
        log.info("reload: changed %s; restarting %s", ", ".join(sorted(changed)), ", ".join(sorted(restart)))
        dns_first = "dns" in restart and "localdns" not in restart
        if dns_first:
            # DNS first: when its new listeners cannot be bound, nothing else has changed yet
            # and the whole running configuration is kept. (New local addresses must exist
            # before DNS can bind them: then DNS comes after them.)
            try:
                await self._replace_dns()
            except Exception as exc:
                self.cfg = old
                self.reload_errors += 1
                RELOADS.labels("failed").inc()
                log.error("reload failed, keeping the running configuration: DNS: %s", exc)
                return False
        try:
            if "source" in restart:
                task = self._tasks.pop("source", None)
                if task is not None:
                    task.cancel()
                    await _quiet(task)
                self._start_source(strict=False)
            if "proxy" in restart:
                self.view.follow = new.proxy.proxy_mode == "none"
                if self.view.follow:
                    self.view.applied(self.store.current.version)
                await self._stop_proxier()
                self._start_proxier()
                if self.proxier is not None:
                    self.proxier.request_sync()
            if "localdns" in restart:
                if self.localdns is not None:
                    t = self._tasks.pop("localdns", None)
                    if t is not None:
                        t.cancel()
                    await localdns_cleanup(self.localdns.runner)
                    self.localdns = None
                await self._start_localdns()
            if "dns" in restart and not dns_first:
                await self._replace_dns()
            if "health" in restart:
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


__all__ = ["Agent", "DNS_PROGRAMMING", "DnsView", "changed_options", "component_inputs", "demo_banner",
           "needs_rules", "restarts"]
