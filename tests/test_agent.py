"""The agent: the DNS view's ordering against the proxier, and the running agent."""
import time

from clusterdns.dnsview import DNS_PROGRAMMING, DnsView, needs_rules
from clusterdns.metrics import REGISTRY
from clusterdns.model import (
    EXTERNAL_NAME,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Namespace,
    Service,
    ServicePort,
)
from clusterdns.state import StateStore
from tests.common import dns_ask as ask
from tests.common import eventually, http_get, shown_eps, shown_ips
from tests.netutil import free_port

PORT = ServicePort("http", "TCP", 8080, target_port=8080)


def svc(name, ip="10.96.0.5", **kw):
    kw.setdefault("ports", (PORT,))
    return Service("ns", name, cluster_ips=(ip,) if ip else (), **kw)


def eps(name, *ips, trigger=None, ready=True):
    return EndpointSlice("ns", f"{name}-abc", name, "IPv4",
                         tuple(Endpoint((ip,), ready=ready) for ip in ips),
                         (EndpointPort("http", "TCP", 8080),), trigger)


def test_needs_rules():
    assert needs_rules(svc("a"))
    assert not needs_rules(svc("h", ip=None, headless=True))
    assert not needs_rules(Service("ns", "x", EXTERNAL_NAME, external_name="db.example.com"))
    assert not needs_rules(svc("noports", ports=()))
    assert not needs_rules(svc("other", proxy_name="someone-else"))


def test_new_service_waits_for_rules_then_appears():
    store = StateStore()
    view = DnsView(store)
    seen = []
    view.subscribe(lambda old, new, delta: seen.append(delta.services))
    store.upsert("Namespace", Namespace("ns"))
    store.upsert("Service", svc("a"))
    store.upsert("EndpointSlice", eps("a", "10.0.0.1"))
    assert shown_ips(view, "a") is None          # no rules yet: not in DNS
    assert view.current.namespaces == store.current.namespaces   # other kinds follow at once
    view.applied(store.current.version - 1)     # an older sync (service, no slice yet)
    assert shown_ips(view, "a") == ("10.96.0.5",)
    assert shown_eps(view, "a") == []             # its endpoint is not routed yet
    view.applied(store.current.version)
    assert shown_eps(view, "a") == ["10.0.0.1"]
    assert any(("ns", "a") in d for d in seen)


def test_delete_and_endpoint_removal_leave_dns_first():
    store = StateStore()
    view = DnsView(store)
    with store.batch():
        store.upsert("Service", svc("a"))
        store.upsert("EndpointSlice", eps("a", "10.0.0.1", "10.0.0.2"))
        store.upsert("Service", svc("b", "10.96.0.6"))
    view.applied(store.current.version)
    store.upsert("EndpointSlice", eps("a", "10.0.0.2"))          # 10.0.0.1 went away
    assert shown_eps(view, "a") == ["10.0.0.2"]                    # before any sync
    store.upsert("EndpointSlice", eps("a", "10.0.0.2", "10.0.0.3"))
    assert shown_eps(view, "a") == ["10.0.0.2"]                    # a new one waits for rules
    store.delete("Service", ("ns", "b"))
    assert shown_ips(view, "b") is None                           # deleted: gone from DNS at once
    view.applied(store.current.version)
    assert shown_eps(view, "a") == ["10.0.0.2", "10.0.0.3"]


def test_clusterip_change_keeps_old_address_until_synced():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a", "10.96.0.5"))
    view.applied(store.current.version)
    store.upsert("Service", svc("a", "10.96.0.9"))
    assert shown_ips(view, "a") == ("10.96.0.5",)   # the old address still has its rules
    view.applied(store.current.version)
    assert shown_ips(view, "a") == ("10.96.0.9",)


def test_services_without_rules_follow_the_store():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("h", ip=None, headless=True))
    store.upsert("EndpointSlice", eps("h", "10.0.0.7"))
    store.upsert("Service", Service("ns", "ext", EXTERNAL_NAME, external_name="db.example.com"))
    assert shown_eps(view, "h") == ["10.0.0.7"]
    assert ("ns", "ext") in view.current.services
    # a Service turning into an ExternalName leaves its ClusterIP in DNS at once
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    store.upsert("Service", Service("ns", "a", EXTERNAL_NAME, external_name="x.example.com"))
    assert view.current.services[("ns", "a")].is_external_name


def test_full_replace_and_unknown_applied_version():
    store = StateStore()
    view = DnsView(store)
    store.replace("Service", [svc("a"), svc("b", "10.96.0.6")])
    view.applied(store.current.version)
    assert set(view.current.services) == {("ns", "a"), ("ns", "b")}
    store.replace("Service", [svc("b", "10.96.0.6"), svc("c", "10.96.0.7")])
    assert set(view.current.services) == {("ns", "b")}
    view.applied(store.current.version + 100)     # unknown: the newest known at or below is used
    assert set(view.current.services) == {("ns", "b"), ("ns", "c")}
    view.applied(1)                               # older than applied: ignored
    assert set(view.current.services) == {("ns", "b"), ("ns", "c")}


def test_view_built_on_a_filled_store():
    store = StateStore()
    store.upsert("Service", svc("a"))
    store.upsert("Service", svc("h", ip=None, headless=True))
    view = DnsView(store)
    assert set(view.current.services) == {("ns", "h")}
    view.applied(store.current.version)
    assert set(view.current.services) == {("ns", "a"), ("ns", "h")}


def test_not_synced_for_dns_until_the_first_rule_sync():
    store = StateStore()
    view = DnsView(store)
    store.replace("Service", [svc("a")])
    store.replace("EndpointSlice", [])
    assert store.current.is_synced("Service", "EndpointSlice")
    assert view.current.synced == frozenset()      # unknown names: SERVFAIL, not NXDOMAIN
    view.applied(store.current.version)
    assert view.current.is_synced("Service", "EndpointSlice")


def test_follow_mode_serves_every_version_at_once():
    store = StateStore()
    store.upsert("Service", svc("a"))
    view = DnsView(store, follow=True)
    assert ("ns", "a") in view.current.services
    store.upsert("Service", svc("b", "10.96.0.6"))
    store.upsert("EndpointSlice", eps("b", "10.0.0.4"))
    assert shown_ips(view, "b") == ("10.96.0.6",) and shown_eps(view, "b") == ["10.0.0.4"]
    store.delete("Service", ("ns", "a"))
    assert ("ns", "a") not in view.current.services


def test_view_states_are_immutable_snapshots():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    before = view.current
    store.delete("Service", ("ns", "a"))
    assert ("ns", "a") in before.services and ("ns", "a") not in view.current.services
    assert view.current.version > before.version


def _count(kind):
    return REGISTRY.get_sample_value("coredns_kubernetes_dns_programming_duration_seconds_count",
                                     {"service_kind": kind}) or 0


def test_dns_programming_duration_observed_when_served():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    before = _count("cluster_ip")
    store.upsert("EndpointSlice", eps("a", "10.0.0.1", trigger=time.time() - 0.5))
    assert _count("cluster_ip") == before          # added endpoint not served yet
    view.applied(store.current.version)
    assert _count("cluster_ip") == before + 1
    h_before = _count("headless_with_selector")
    store.upsert("Service", svc("h", ip=None, headless=True))
    store.upsert("EndpointSlice", eps("h", "10.0.0.9", trigger=time.time()))
    assert _count("headless_with_selector") == h_before + 1
    assert DNS_PROGRAMMING is not None


# ---------------------------------------------------------------- the running agent

import asyncio  # noqa: E402

import dns.asyncquery  # noqa: E402
import dns.exception  # noqa: E402
import dns.message  # noqa: E402
import dns.rcode  # noqa: E402
import pytest  # noqa: E402

from clusterdns.agent import Agent  # noqa: E402
from clusterdns.config import load  # noqa: E402
from clusterdns.proxy.apply import Result  # noqa: E402
from clusterdns.synthetic import to_manifest  # noqa: E402


class SlowKernel:
    """A CommandRunner standing in for iptables: restores take `delay` seconds and
    are recorded with their completion time; reads answer as an empty kernel. It keeps
    the KUBE-SERVICES rules (nat and filter) as a kernel would: a declared chain is
    flushed, -A/-I add, -D delete (partial texts carry only what changed)."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.applied: list[tuple[float, str]] = []   # (completed at, restore text)
        self.gate: asyncio.Event | None = None
        self.rules: dict[str, set[str]] = {"nat": set(), "filter": set()}

    async def run(self, argv, stdin=None):
        argv = tuple(argv)
        if "restore" in argv[0] and stdin is not None and "KUBE-" in stdin:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.delay)
            self._apply(stdin)
            self.applied.append((time.monotonic(), stdin))
        return Result(argv, 0)

    def _apply(self, text: str) -> None:
        table = ""
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif table in self.rules and line.startswith(":KUBE-SERVICES "):
                self.rules[table] = set()
            elif table in self.rules and line[:3] in ("-A ", "-I ", "-D ") and line[3:].startswith("KUBE-SERVICES "):
                spec = line[3:].split(" ", 1)[1]
                if line.startswith("-I KUBE-SERVICES 1 "):
                    spec = spec[2:]
                if line.startswith("-D "):
                    self.rules[table].discard(spec)
                else:
                    self.rules[table].add(spec)

    def has_rules_for(self, ip: str) -> bool:
        return any(f"-d {ip} " in spec for specs in self.rules.values() for spec in specs)


def manifest(path, services):
    """services: {name: (cluster_ip, [endpoint ips])} in namespace ns."""
    recs = [("Namespace", Namespace("ns"))]
    for name, (ip, ips) in services.items():
        recs.append(("Service", svc(name, ip)))
        recs.append(("EndpointSlice", eps(name, *ips)))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_manifest(recs))
    tmp.replace(path)   # atomic: the source never reads half a file


def agent_cfg(tmp_path, *extra):
    return load(["agent", "--manifest", str(tmp_path / "cluster.json"), "--listen", "127.0.0.1:0",
                 "--no-upstream", "--health-listen", "127.0.0.1:0", "--metrics-listen", "none", "--proxy-metrics-listen", "none",
                 "--min-sync-period", "0", "--lameduck", "0.5", *extra], env={})


async def started(cfg, kernel, argv=None):
    agent = Agent(cfg, argv=argv, executor=kernel)
    await agent.start()
    agent.source.interval = 0.05
    return agent, agent.dns.bound[0][1]


A_NAME = "a.ns.svc.cluster.local."
B_NAME = "b.ns.svc.cluster.local."


async def test_new_service_is_nxdomain_until_its_rules_are_in(tmp_path):
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    kernel = SlowKernel()
    agent, port = await started(agent_cfg(tmp_path), kernel)
    try:
        await eventually(lambda: _answers(port, A_NAME, "10.96.0.5"))
        kernel.delay = 1.0
        manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"]), "b": ("10.96.0.6", ["10.0.0.2"])})
        await eventually(lambda: _has(agent.store.current, "b"))
        seen_nx_after_store = False
        while True:
            rcode, answers, _ = await ask(port, B_NAME)
            if rcode == "NOERROR" and answers:
                break
            # (not "no rules in the kernel": they may land between this answer and a look at
            # the kernel; what must hold is the converse, checked below)
            assert rcode == "NXDOMAIN"
            seen_nx_after_store = True
            await asyncio.sleep(0.05)
        assert answers == ["10.96.0.6"]
        assert seen_nx_after_store                     # DNS waited for the slow kernel...
        assert kernel.has_rules_for("10.96.0.6")       # ...and answered only once the rules were in

        # Deleting: DNS first, rules after.
        manifest(tmp_path / "cluster.json", {"b": ("10.96.0.6", ["10.0.0.2"])})
        await eventually(lambda: _rcode(port, A_NAME, "NXDOMAIN"), timeout=3)
        assert kernel.has_rules_for("10.96.0.5")       # the old rules are still being replaced
        await eventually(lambda: _kernel_lacks(kernel, "10.96.0.5"), timeout=5)
    finally:
        await agent.stop()


async def _answers(port, name, want):
    rcode, answers, _ = await ask(port, name)
    return answers == [want]


async def _rcode(port, name, want):
    return (await ask(port, name))[0] == want


async def _has(state, name):
    return ("ns", name) in state.services


async def _kernel_lacks(kernel, ip):
    return not kernel.has_rules_for(ip)


async def test_proxy_mode_none_follows_the_store(tmp_path):
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    agent, port = await started(agent_cfg(tmp_path, "--proxy-mode", "none"), SlowKernel())
    try:
        assert agent.proxier is None and agent.view.follow
        await eventually(lambda: _answers(port, A_NAME, "10.96.0.5"))
        manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"]), "b": ("10.96.0.6", [])})
        await eventually(lambda: _answers(port, B_NAME, "10.96.0.6"))
    finally:
        await agent.stop()


async def test_ready_names_what_is_missing_and_lameduck(tmp_path):
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    kernel = SlowKernel()
    kernel.gate = asyncio.Event()      # the first rule sync cannot finish yet
    agent, port = await started(agent_cfg(tmp_path, "--lameduck", "2"), kernel)
    hport = agent.health.bound[0][1]
    try:
        await eventually(lambda: _has(agent.store.current, "a"))
        status, text = await http_get(hport, "/ready")
        assert status == 503 and "first rule sync not done" in text and "Service not synced" not in text
        # Nothing known to be in the kernel yet: SERVFAIL (try again), not NXDOMAIN.
        assert (await ask(port, A_NAME))[0] == "SERVFAIL"
        kernel.gate.set()
        await eventually(lambda: _ready(hport))
        assert (await http_get(hport, "/health"))[0] == 200
        assert (await http_get(hport, "/healthz"))[0] == 200

        agent.begin_shutdown()
        waiter = asyncio.ensure_future(agent.wait())
        await asyncio.sleep(0.1)
        status, text = await http_get(hport, "/ready")
        assert status == 503 and "lameduck" in text
        assert (await http_get(hport, "/health"))[0] == 200
        assert (await ask(port, A_NAME))[1] == ["10.96.0.5"]   # still answering
        # The proxier stopped at the signal: a Service added now gets no rules from this
        # process (its successor programs it), while the source still follows the change.
        manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"]), "b": ("10.96.0.6", ["10.0.0.2"])})
        await eventually(lambda: _has(agent.store.current, "b"), timeout=1.5, what="the change, within the lameduck")
        await asyncio.sleep(0.05)
        assert not kernel.has_rules_for("10.96.0.6") and kernel.has_rules_for("10.96.0.5")
        assert await asyncio.wait_for(waiter, 5) == 0
        with pytest.raises((ConnectionRefusedError, dns.exception.Timeout)):   # nothing answers any more
            await ask(port, A_NAME)
    finally:
        await agent.stop()


async def _ready(hport):
    return (await http_get(hport, "/ready"))[0] == 200


async def test_ready_before_the_state_is_listed(tmp_path):
    # The manifest does not exist yet... the agent refuses it up front (exit 2 path).
    from clusterdns.sources.manifest import ManifestError
    agent = Agent(agent_cfg(tmp_path), executor=SlowKernel())
    with pytest.raises(ManifestError):
        await agent.start()
    await agent.stop()


async def test_config_reload_on_change_and_bad_file_kept(tmp_path):
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    conf = tmp_path / "agent.yaml"
    conf.write_text("apiVersion: clusterdns.io/v1alpha1\nkind: ClusterDNSConfiguration\nttl: 5\n"
                    "min-sync-period: 0\n")
    argv = ["agent", "--manifest", str(tmp_path / "cluster.json"), "--listen", "127.0.0.1:0",
            "--no-upstream", "--health-listen", "none", "--metrics-listen", "none", "--proxy-metrics-listen", "none", "--lameduck", "0",
            "--config", str(conf)]
    cfg = load(argv, env={})
    agent, port = await started(cfg, SlowKernel(), argv=argv)
    try:
        await eventually(lambda: _answers(port, A_NAME, "10.96.0.5"))
        assert (await ask(port, A_NAME))[2] == 5
        conf.write_text("ttl: 17\nmin-sync-period: 0\n")
        await eventually(lambda: _ttl(agent, A_NAME, 17), timeout=5)
        await eventually(lambda: _value(agent.reloads == 1), timeout=5)   # the old listener closes after
        assert agent.cfg.dns.ttl == 17
        assert agent.proxier.cfg.proxy.min_sync_period == 0
        # The proxier and the source restart on a reload that changes their options;
        # the agent keeps running and changes keep flowing.
        waiting = asyncio.ensure_future(agent.wait())
        conf.write_text("ttl: 17\nmin-sync-period: 0.1\npods: verified\n")
        await eventually(lambda: _value(agent.reloads == 2), timeout=5)
        assert agent.proxier.cfg.proxy.min_sync_period == 0.1 and agent.source.store is agent.store
        agent.source.interval = 0.05
        manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"]), "b": ("10.96.0.6", ["10.0.0.2"])})
        await eventually(lambda: _answers_quietly(agent.dns.bound[0][1], B_NAME, "10.96.0.6"), timeout=5)
        assert not waiting.done()
        conf.write_text("ttl: [not, a, number\n")           # broken YAML
        await eventually(lambda: _value(agent.reload_errors >= 1), timeout=5)
        assert agent.cfg.dns.ttl == 17
        assert (await ask(agent.dns.bound[0][1], A_NAME))[2] == 17   # still served, old config
        conf.write_text("ttl: 99999\n")                      # valid YAML, invalid value
        await eventually(lambda: _value(agent.reload_errors >= 2), timeout=5)
        assert agent.cfg.dns.ttl == 17
        assert await agent.reload() is False                 # SIGHUP path, same result
        agent.begin_shutdown()
        assert await asyncio.wait_for(waiting, 5) == 0
    finally:
        await agent.stop()


async def test_reload_onto_a_busy_port_keeps_the_running_listener(tmp_path):
    import socket
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    first, busy, third = free_port(), free_port(), free_port()
    conf = tmp_path / "agent.yaml"
    conf.write_text(f"listen: ['127.0.0.1:{first}']\nmin-sync-period: 0\n")
    argv = ["agent", "--manifest", str(tmp_path / "cluster.json"), "--no-upstream", "--health-listen", "none",
            "--metrics-listen", "none", "--proxy-metrics-listen", "none", "--lameduck", "0", "--config", str(conf)]
    # Another program holds the new port (UDP and TCP, without SO_REUSEPORT).
    holders = [socket.socket(socket.AF_INET, kind) for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM)]
    for h in holders:
        h.bind(("127.0.0.1", busy))
    holders[1].listen()
    agent, port = await started(load(argv, env={}), SlowKernel(), argv=argv)
    try:
        assert port == first
        await eventually(lambda: _answers(first, A_NAME, "10.96.0.5"))
        conf.write_text(f"listen: ['127.0.0.1:{busy}']\nmin-sync-period: 0\nttl: 9\n")
        await eventually(lambda: _value(agent.reload_errors >= 1), timeout=5)
        # The old listener still answers, with the old configuration, and nothing else moved.
        assert agent.dns.bound == [("127.0.0.1", first)]
        assert agent.cfg.dns.ttl == 5 and agent.cfg.listen_addresses() == [("127.0.0.1", first)]
        assert await ask(first, A_NAME) == ("NOERROR", ["10.96.0.5"], 5)
        # A later reload onto a free port moves the listener.
        conf.write_text(f"listen: ['127.0.0.1:{third}']\nmin-sync-period: 0\nttl: 9\n")
        await eventually(lambda: _value(agent.reloads >= 1), timeout=5)
        assert agent.dns.bound == [("127.0.0.1", third)]
        assert await ask(third, A_NAME) == ("NOERROR", ["10.96.0.5"], 9)
        with pytest.raises(dns.exception.Timeout):
            await ask(first, A_NAME)
    finally:
        await agent.stop()
        for h in holders:
            h.close()


async def _ttl(agent, name, want):
    if agent.dns is None or not agent.dns.bound:
        return False
    try:   # a query may hit the listener being replaced by the reload
        return (await ask(agent.dns.bound[0][1], name))[2] == want
    except Exception:
        return False


async def _value(v):
    return v


async def test_demo_mode_banner_and_printing_proxier(capsys):
    cfg = load(["agent", "--listen", "127.0.0.1:0", "--no-upstream", "--health-listen", "none",
                "--metrics-listen", "none", "--proxy-metrics-listen", "none"], env={})
    assert cfg.source.demo and not cfg.applying
    agent = Agent(cfg)
    await agent.start()
    try:
        port = agent.dns.bound[0][1]
        banner = agent.banner()
        assert f"dig @127.0.0.1 -p {port} testapp-svc.testapp.svc.cluster.local" in banner
        assert "printed, not applied" in banner
        await eventually(lambda: _answers(port, "testapp-svc.testapp.svc.cluster.local.", "172.20.36.232"))
        assert agent.proxier.syncs >= 1
    finally:
        await agent.stop()
    assert "-A KUBE-SERVICES" in capsys.readouterr().out   # the rules went to stdout


async def test_signals_in_a_real_process(tmp_path):
    """SIGHUP reloads; SIGTERM: lameduck (answering, /ready 503, /health 200), then exit 0."""
    import signal
    import subprocess
    import sys
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    conf = tmp_path / "agent.yaml"
    conf.write_text("ttl: 5\n")
    port, hport = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterdns", "agent", "--manifest", str(tmp_path / "cluster.json"),
         "--listen", f"127.0.0.1:{port}", "--no-upstream", "--proxy-mode", "none", "--config", str(conf),
         "--health-listen", f"127.0.0.1:{hport}", "--metrics-listen", "none", "--proxy-metrics-listen", "none", "--lameduck", "1.5",
         "--lameduck-handover", "0", "--loop", "asyncio"], stderr=subprocess.PIPE, text=True)
    try:
        await eventually(lambda: _answers_quietly(port, A_NAME, "10.96.0.5"), timeout=10)
        conf.write_text("ttl: 9\n")
        proc.send_signal(signal.SIGHUP)
        await eventually(lambda: _ttl_at(port, A_NAME, 9), timeout=5)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert proc.poll() is None
        status, text = await http_get(hport, "/ready")
        assert status == 503 and "lameduck" in text
        assert (await http_get(hport, "/health"))[0] == 200
        assert (await ask(port, A_NAME))[1] == ["10.96.0.5"]
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert "reload: changed ttl" in err and "lameduck" in err


async def _answers_quietly(port, name, want):
    try:
        return await _answers(port, name, want)
    except Exception:
        return False


async def _ttl_at(port, name, want):
    try:
        return (await ask(port, name))[2] == want
    except Exception:
        return False


def _successor_socket(port):
    """A socket bound as a restarted agent's would be (SO_REUSEPORT on the same address)."""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    return s


async def test_lameduck_answers_until_a_successor_listens(tmp_path):
    """After --lameduck the agent keeps answering while no other process listens on its DNS
    address; once one binds it (SO_REUSEPORT), it stops, and queries reach the successor."""
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    port = free_port()
    cfg = load(["agent", "--manifest", str(tmp_path / "cluster.json"), "--listen", f"127.0.0.1:{port}",
                "--no-upstream", "--proxy-mode", "none", "--health-listen", "127.0.0.1:0",
                "--metrics-listen", "none", "--proxy-metrics-listen", "none",
                "--lameduck", "0.1", "--lameduck-handover", "60"], env={})
    agent = Agent(cfg)
    await agent.start()
    successor = None
    try:
        await eventually(lambda: _answers_quietly(port, A_NAME, "10.96.0.5"))
        agent.begin_shutdown()
        waiter = asyncio.ensure_future(agent.wait())
        await asyncio.sleep(0.6)                      # well past the 0.1 s lameduck
        assert not waiter.done()
        assert (await ask(port, A_NAME))[1] == ["10.96.0.5"]   # still answering
        successor = _successor_socket(port)
        assert await asyncio.wait_for(waiter, 10) == 0
        # the old sockets are closed: a query now reaches the successor
        q = dns.message.make_query(A_NAME, "A")
        successor.settimeout(5)
        send = asyncio.ensure_future(dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=3))
        data = b""
        while not data:   # (the old server's zero-length wake-ups may land here too)
            data, _ = await asyncio.get_running_loop().run_in_executor(None, successor.recvfrom, 512)
        assert dns.message.from_wire(data).question == q.question
        send.cancel()
    finally:
        if successor is not None:
            successor.close()
        await agent.stop()


async def test_lameduck_handover_is_bounded(tmp_path):
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    port = free_port()
    cfg = load(["agent", "--manifest", str(tmp_path / "cluster.json"), "--listen", f"127.0.0.1:{port}",
                "--no-upstream", "--proxy-mode", "none", "--health-listen", "127.0.0.1:0",
                "--metrics-listen", "none", "--proxy-metrics-listen", "none",
                "--lameduck", "0.1", "--lameduck-handover", "0.8"], env={})
    agent = Agent(cfg)
    await agent.start()
    try:
        await eventually(lambda: _answers_quietly(port, A_NAME, "10.96.0.5"))
        agent.begin_shutdown()
        waiter = asyncio.ensure_future(agent.wait())
        await asyncio.sleep(0.4)
        assert not waiter.done() and (await ask(port, A_NAME))[1] == ["10.96.0.5"]
        assert await asyncio.wait_for(waiter, 10) == 0   # no successor: it stops at the bound
        with pytest.raises((ConnectionRefusedError, dns.exception.Timeout)):
            await ask(port, A_NAME)
    finally:
        await agent.stop()


async def test_restarted_agent_listens_after_its_first_sync_while_another_answers(tmp_path, monkeypatch):
    """Rules in the kernel (adoption) and another process on the DNS address: the new agent
    leaves the answering to it until its own first rule sync is done; then it listens."""
    from clusterdns.proxy.proxier import Proxier
    manifest(tmp_path / "cluster.json", {"a": ("10.96.0.5", ["10.0.0.1"])})

    async def programmed(self):
        return {("10.96.0.5", "TCP", 8080): frozenset({"10.0.0.1:8080"})}
    monkeypatch.setattr(Proxier, "programmed", programmed)
    port = free_port()
    other = _successor_socket(port)        # the previous agent, still answering
    kernel = SlowKernel()
    kernel.gate = asyncio.Event()          # the first rule sync cannot finish yet
    cfg = load(["agent", "--manifest", str(tmp_path / "cluster.json"), "--listen", f"127.0.0.1:{port}",
                "--no-upstream", "--health-listen", "127.0.0.1:0", "--metrics-listen", "none",
                "--proxy-metrics-listen", "none", "--min-sync-period", "0", "--lameduck", "0"], env={})
    agent = Agent(cfg, executor=kernel)
    starting = asyncio.ensure_future(agent.start())
    try:
        await eventually(lambda: _listed(agent))
        assert agent.view.adopted > 0
        await asyncio.sleep(0.3)
        assert not starting.done() and agent.dns is None   # not listening: the other one answers
        kernel.gate.set()
        await asyncio.wait_for(starting, 10)
        assert agent.proxier.syncs > 0
        other.close()
        other = None
        assert (await ask(port, A_NAME))[1] == ["10.96.0.5"]
    finally:
        if other is not None:
            other.close()
        if not starting.done():
            kernel.gate.set()
            await asyncio.wait_for(starting, 10)
        await agent.stop()


async def _listed(agent):
    return agent.store.current.is_synced("Service", "EndpointSlice")
