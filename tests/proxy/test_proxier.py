"""The Proxier's sync decisions against a recording runner (no kernel), plus
health servers over real sockets on loopback and cleanup's command text."""
import asyncio
import dataclasses
import io
import json

import pytest

from clusterdns.config import load
from clusterdns.proxy import proxier as px
from clusterdns.proxy.apply import RecordingRunner, Result
from clusterdns.proxy.healthcheck import ProxierHealth, ServiceHealthServers, local_endpoint_counts
from clusterdns.sources.manifest import DEMO_MANIFEST, publish
from clusterdns.state import StateStore
from tests.demo import demo_records
from tests.netutil import free_port
from tests.nslib import requires

BASE = ["proxy", "--manifest", DEMO_MANIFEST, "--node-ip", "192.168.49.2", "--node-name", "node-a",
        "--cluster-cidr", "10.161.0.0/16", "--min-sync-period", "0", "--apply"]


def cfg_of(*extra):
    return load(BASE + list(extra), env={})


def restores(runner):
    return [(a, s) for a, s in runner.calls if a[0].endswith("-restore")]


def metric(name, **labels):
    v = px.REGISTRY.get_sample_value(name, labels or None)
    return v or 0.0


class Rig:
    def __init__(self, cfg, respond=None, synced=True, out=None):
        self.runner = RecordingRunner(respond)
        self.store = StateStore()
        self.proxier = px.Proxier(cfg, self.store, executor=self.runner, out=out)
        self.versions = []
        self.proxier.add_listener(self.versions.append)
        if synced:
            publish(self.store, demo_records())
        self.task = None

    async def __aenter__(self):
        self.task = asyncio.create_task(self.proxier.run())
        return self

    async def __aexit__(self, *exc):
        await self.proxier.stop()
        await asyncio.wait_for(self.task, 2)

    async def synced(self, version=0):
        assert await self.proxier.wait_synced(version, timeout=3)


async def test_no_writes_until_services_and_slices_are_listed():
    cfg = cfg_of()
    rig = Rig(cfg, synced=False)
    async with rig:
        records = demo_records()
        with rig.store.batch():
            rig.store.replace("Service", [r for k, r in records if k == "Service"], synced=True)
            rig.store.replace("EndpointSlice", [r for k, r in records if k == "EndpointSlice"], synced=False)
        await asyncio.sleep(0.1)
        assert rig.runner.calls == []
        assert rig.proxier.syncs == 0
        rig.store.mark_synced("EndpointSlice")
        await rig.synced()
        assert len(restores(rig.runner)) == 1


async def test_full_sync_then_partial_sync_of_the_changed_service():
    rig = Rig(cfg_of())
    async with rig:
        await rig.synced()
        (argv, text), = restores(rig.runner)
        assert argv[:5] == ("iptables-nft-restore", "-w", "5", "--noflush", "--counters")
        assert "*mangle" in text and "-I PREROUTING" in text   # full: canary and jumps
        assert "KUBE-SVC-" in text and text.count(":KUBE-SEP-") > 74
        full_syncs = metric("kubeproxy_sync_full_proxy_rules_duration_seconds_count")
        partial_syncs = metric("kubeproxy_sync_partial_proxy_rules_duration_seconds_count")

        sl = rig.store.current.slices[("kube-system", "kube-dns-7fz8q")]
        rig.store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        version = rig.store.current.version
        await rig.synced(version)
        argv, text = restores(rig.runner)[-1]
        assert "*mangle" not in text and "-I " not in text
        assert text.count(":KUBE-SEP-") < 10    # only kube-dns's chains are rewritten
        assert metric("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == partial_syncs + 1
        assert metric("kubeproxy_sync_full_proxy_rules_duration_seconds_count") == full_syncs
        assert rig.proxier.applied_version == version
        assert rig.versions[-1] == version


async def test_removed_udp_endpoint_clears_conntrack_after_the_sync():
    rig = Rig(cfg_of())
    async with rig:
        await rig.synced()
        sl = rig.store.current.slices[("kube-system", "kube-dns-7fz8q")]
        gone = sl.endpoints[1].addresses[0]
        rig.store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        await rig.synced(rig.store.current.version)
        cmds = rig.runner.commands()
        ct = [c for c in cmds if c.startswith("conntrack -D")]
        assert f"conntrack -D -f ipv4 -p udp --orig-dst 172.20.0.10 --orig-port-dst 53 --reply-src {gone}" in ct
        last_restore = max(i for i, c in enumerate(cmds) if "-restore" in c)
        assert cmds.index(ct[-1]) > last_restore   # deleted only after the rules are in


async def test_failed_partial_sync_keeps_version_counts_and_retries_full():
    fail = {"on": False}

    def respond(argv, stdin):
        if fail["on"] and argv[0].endswith("-restore"):
            return Result(argv, 1, "", "iptables-restore: line 7 failed\n")
        return None

    cfg = cfg_of("--sync-period", "0.3")
    rig = Rig(cfg, respond)
    async with rig:
        await rig.synced()
        good = rig.proxier.applied_version
        before = metric("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total")
        fail["on"] = True
        sl = rig.store.current.slices[("kube-system", "kube-dns-7fz8q")]
        rig.store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        for _ in range(100):
            if rig.proxier.failures:
                break
            await asyncio.sleep(0.01)
        assert rig.proxier.failures >= 1
        assert "line 7 failed" in rig.proxier.last_error
        assert rig.proxier.applied_version == good
        assert metric("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total") == before + 1
        fail["on"] = False
        n = len(restores(rig.runner))
        await rig.synced(rig.store.current.version)   # the retry, after --sync-period
        argv, text = restores(rig.runner)[n]
        assert "*mangle" in text     # a full sync
        assert not any(c.startswith("conntrack") for c in rig.runner.commands()[:n])


async def test_periodic_syncs_are_partial_and_the_full_one_hourly(monkeypatch):
    """As kube-proxy: a sync every --sync-period, partial; a full one at start and once an hour."""
    from clusterdns.proxy import proxier
    rig = Rig(cfg_of("--sync-period", "0.2"))
    async with rig:
        await rig.synced()
        await asyncio.sleep(0.5)
        syncs = metric("kubeproxy_sync_proxy_rules_duration_seconds_count")
        await asyncio.sleep(0.5)
        assert metric("kubeproxy_sync_proxy_rules_duration_seconds_count") >= syncs + 2   # periodic syncs
        assert ["*mangle" in t for _, t in restores(rig.runner)].count(True) == 1        # none full
        monkeypatch.setattr(proxier, "FULL_SYNC_PERIOD", 0.3)   # an hour later
        await asyncio.sleep(0.5)
        assert ["*mangle" in t for _, t in restores(rig.runner)].count(True) >= 2


async def test_jumps_are_not_inserted_twice(monkeypatch):
    """Repeated full syncs (here every 0.2 s) put back a missing jump and never add a second."""
    from clusterdns.proxy import proxier
    monkeypatch.setattr(proxier, "FULL_SYNC_PERIOD", 0.2)
    jumps = {"save": ""}

    def respond(argv, stdin):
        if argv[0].endswith("-save"):
            return Result(argv, 0, jumps["save"])
        if "-C" in argv:
            return Result(argv, 1, "", "iptables: Bad rule (does a matching rule exist in that chain?).")
        return None

    cfg = cfg_of("--sync-period", "0.2")
    rig = Rig(cfg, respond)
    async with rig:
        await rig.synced()
        from clusterdns.proxy import iptables
        # The kernel now holds every jump but one.
        wanted = iptables.jump_rules(cfg, 4)
        jumps["save"] = "*nat\n" + "".join(f"-A {c} {s}\n" for t, c, s in wanted[1:]) + "COMMIT\n"
        n = len(rig.runner.calls)
        await asyncio.sleep(0.45)
        later = rig.runner.commands()[n:]
        texts = [s for a, s in rig.runner.calls[n:] if a[0].endswith("-restore")]
        assert texts and all("-I " not in t for t in texts)
        t, c, _ = wanted[0]
        assert any(f"-t {t} -I {c}" in cmd for cmd in later)


async def test_dual_stack_programs_both_families():
    rig = Rig(cfg_of("--node-ip", "fd00::2"))
    async with rig:
        await rig.synced()
        tools = {a[0] for a, _ in restores(rig.runner)}
        assert tools == {"iptables-nft-restore", "ip6tables-nft-restore"}


async def test_nftables_mode_applies_with_nft():
    pytest.importorskip("clusterdns.proxy.nftables")
    rig = Rig(cfg_of("--proxy-mode", "nftables"))
    async with rig:
        await rig.synced()
        (argv, text), = [(a, s) for a, s in rig.runner.calls if a[:2] == ("nft", "-f")]
        assert "kube-proxy" in text


async def test_mode_none_writes_nothing_but_reports_synced():
    rig = Rig(cfg_of("--proxy-mode", "none"))
    async with rig:
        await rig.synced()
        assert rig.runner.calls == []


async def test_dry_run_prints_instead_of_applying():
    out = io.StringIO()
    cfg = load([a for a in BASE if a != "--apply"] + ["--dry-run"], env={})
    store = StateStore()
    publish(store, demo_records())
    proxier = px.Proxier(cfg, store, out=out)
    task = asyncio.create_task(proxier.run())
    assert await proxier.wait_synced(timeout=3)
    await proxier.stop()
    await asyncio.wait_for(task, 2)
    text = out.getvalue()
    assert text.startswith("# iptables-") and "KUBE-SERVICES" in text and "172.20.36.232" in text
    assert proxier.applied_version == store.current.version


def test_node_families():
    assert px.node_families(cfg_of()) == [4]
    assert px.node_families(cfg_of("--node-ip", "fd00::2")) == [4, 6]


# ---------------------------------------------------------------- health

def test_proxier_health_semantics():
    now = [1000.0]
    h = ProxierHealth(60.0, clock=lambda: now[0])
    assert h.respond("/healthz")[0] == 200
    h.queued_update()
    now[0] += 59
    assert h.respond("/healthz")[0] == 200
    now[0] += 2
    status, headers, body = h.respond("/healthz")
    assert status == 503
    doc = json.loads(body)
    assert doc["lastUpdated"] == "0001-01-01T00:00:00Z" and doc["currentTime"].endswith("Z")
    h.updated()
    assert h.respond("/healthz")[0] == 200 and h.respond("/livez")[0] == 200
    assert h.respond("/nope")[0] == 404


async def _get(port, path="/"):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode(), body


async def test_service_health_servers_follow_local_endpoints():
    cfg = cfg_of()
    store = StateStore()
    publish(store, demo_records())
    counts = local_endpoint_counts(store.current, cfg.proxy.node_name)
    assert counts == {("testapp", "testapp-lb"): (32000, 1)}
    port = free_port()
    servers = ServiceHealthServers("127.0.0.1")
    await servers.sync({("testapp", "testapp-lb"): (port, 2)})
    status, head, body = await _get(port)
    assert status == 200 and "X-Load-Balancing-Endpoint-Weight: 2" in head
    assert json.loads(body)["localEndpoints"] == 2
    await servers.sync({("testapp", "testapp-lb"): (port, 0)})
    assert (await _get(port))[0] == 503
    await servers.sync({})
    assert servers.ports == set()
    with pytest.raises(OSError):
        await _get(port)
    await servers.close()


def test_terminating_endpoints_do_not_count_for_health():
    store = StateStore()
    publish(store, demo_records())
    sl = next(s for s in store.current.slices.values() if s.service == "testapp-lb")
    eps = tuple(dataclasses.replace(e, ready=False, terminating=True) if e.node_name == "node-a" else e
                for e in sl.endpoints)
    store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=eps))
    assert local_endpoint_counts(store.current, "node-a")[("testapp", "testapp-lb")][1] == 0


# ---------------------------------------------------------------- cleanup

SAVE = """*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:OTHER-CHAIN - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j OTHER-CHAIN
COMMIT
"""


async def test_cleanup_removes_ours_only():
    def respond(argv, stdin):
        if argv == ("iptables-nft-save",):
            return Result(argv, 0, SAVE)
        if argv[0] == "nft" and argv[1] == "list":
            return Result(argv, 0, "table ip filter\n")
        if argv[:3] in (("ip", "link", "show"), ("ip", "link", "del")):
            return Result(argv, 1, "", "Device does not exist")
        if any("CLUSTERDNS" in a for a in argv):   # no local-DNS chains installed
            return Result(argv, 1, "", "No chain/target/match by that name.")
        return Result(argv, 0, "")

    runner = RecordingRunner(respond)
    done = await px.cleanup(cfg_of(), runner)
    assert done == ["iptables-nft IPv4"]
    (argv, text), = restores(runner)
    assert "-X KUBE-SVC-ABCDEFGHIJKLMNOP" in text and "-X KUBE-SERVICES" in text
    assert "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES" in text
    assert "OTHER-CHAIN" not in text and "KUBE-KUBELET-CANARY" not in text
    assert not any(a[:2] == ("nft", "-f") for a, _ in runner.calls)


async def test_missing_canary_forces_a_full_sync():
    canary = {"present": True}

    def respond(argv, stdin):
        if "-S" in argv and "KUBE-PROXY-CANARY" in argv:
            return Result(argv, 0 if canary["present"] else 1, "", "" if canary["present"] else "No chain")
        return None

    now = [5000.0]
    cfg = cfg_of("--sync-period", "10")
    runner = RecordingRunner(respond)
    store = StateStore()
    proxier = px.Proxier(cfg, store, executor=runner, monotonic=lambda: now[0])
    publish(store, demo_records())
    task = asyncio.create_task(proxier.run())
    try:
        assert await proxier.wait_synced(timeout=3)
        sl = store.current.slices[("kube-system", "kube-dns-7fz8q")]
        # Within half a sync period: a partial sync, no canary check.
        now[0] += 1
        store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        assert await proxier.wait_synced(store.current.version, timeout=3)
        assert "*mangle" not in restores(runner)[-1][1]
        assert not any("-S" in a and "KUBE-PROXY-CANARY" in a for a, _ in runner.calls)
        # Later the tables were flushed behind our back: the canary is gone.
        canary["present"] = False
        now[0] += 6
        store.upsert("EndpointSlice", sl)
        assert await proxier.wait_synced(store.current.version, timeout=3)
        assert any("-S" in a and "KUBE-PROXY-CANARY" in a for a, _ in runner.calls)
        assert "*mangle" in restores(runner)[-1][1]
    finally:
        await proxier.stop()
        await asyncio.wait_for(task, 2)


async def test_ipvs_mode_applies_through_ipvsadm_restore():
    pytest.importorskip("clusterdns.proxy.ipvs")
    rig = Rig(cfg_of("--proxy-mode", "ipvs"))
    async with rig:
        await rig.synced()
        cmds = rig.runner.commands()
        assert "ipvsadm-restore" in cmds and "ipset restore -exist" in cmds
        ipvsadm = next(s for a, s in rig.runner.calls if a == ("ipvsadm-restore",))
        assert "172.20.36.232:8080" in ipvsadm


async def test_nftables_periodic_syncs_are_partial():
    pytest.importorskip("clusterdns.proxy.nftables")
    rig = Rig(cfg_of("--proxy-mode", "nftables", "--sync-period", "0.2"))
    async with rig:
        await rig.synced()
        await asyncio.sleep(0.5)
        assert rig.proxier.syncs >= 2
        texts = [s for a, s in rig.runner.calls if a[:2] == ("nft", "-f")]
        assert len(texts) == 1     # nothing changed: nothing more to apply


async def test_network_programming_and_no_local_endpoint_metrics():
    rig = Rig(cfg_of("--node-name", "node-z"))   # no endpoint is local to node-z
    async with rig:
        await rig.synced()
        assert metric("kubeproxy_sync_proxy_rules_no_local_endpoints_total", traffic_policy="external") == 1
        count = metric("kubeproxy_network_programming_duration_seconds_count")
        sl = rig.store.current.slices[("kube-system", "kube-dns-7fz8q")]
        changed_at = px.time.time() - 2.0
        rig.store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1],
                                                              trigger_time=changed_at))
        await rig.synced(rig.store.current.version)
        assert metric("kubeproxy_network_programming_duration_seconds_count") == count + 1
        total = metric("kubeproxy_network_programming_duration_seconds_sum")
        assert total >= 2.0
        assert metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") >= changed_at


def test_proxy_command_with_a_broken_manifest_exits_2(tmp_path, capsys):
    from clusterdns.cli import main
    bad = tmp_path / "bad.yaml"
    bad.write_text("items: [\n")
    assert main(["proxy", "--manifest", str(bad), "--dry-run", "--health-listen", "none",
                 "--metrics-listen", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0]


@requires("iptables-legacy-restore")
def test_cleanup_removes_rules_of_the_legacy_backend_too(netns):
    import subprocess

    from clusterdns.proxy import iptables
    from clusterdns.proxy.apply import SubprocessRunner
    ns = netns
    cfg = cfg_of()
    store = StateStore()
    publish(store, demo_records())
    text = iptables.render(store.current, cfg, 4).text
    subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy-restore", "--noflush"], input=text,
                   text=True, check=True)
    subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy", "-A", "INPUT", "-p", "tcp", "--dport",
                    "9999", "-j", "ACCEPT"], check=True)
    done = asyncio.run(px.cleanup(cfg, SubprocessRunner(["ip", "netns", "exec", ns])))
    assert "iptables-legacy IPv4" in done
    left = subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy-save"], capture_output=True,
                          text=True).stdout
    assert "KUBE-" not in left and "--dport 9999 -j ACCEPT" in left


async def test_dry_run_prints_again_only_when_something_changed():
    out = io.StringIO()
    cfg = load([a for a in BASE if a != "--apply"] + ["--dry-run", "--sync-period", "0.1"], env={})
    store = StateStore()
    publish(store, demo_records())
    proxier = px.Proxier(cfg, store, out=out)
    task = asyncio.create_task(proxier.run())
    try:
        assert await proxier.wait_synced(timeout=3)
        await asyncio.sleep(0.35)
        assert out.getvalue().count("# iptables-") == 1
        sl = store.current.slices[("kube-system", "kube-dns-7fz8q")]
        store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        assert await proxier.wait_synced(store.current.version, timeout=3)
        assert out.getvalue().count("# iptables-") == 2
    finally:
        await proxier.stop()
        await asyncio.wait_for(task, 2)


@pytest.mark.parametrize("backend, saves", [("legacy", 1), ("nft", 0)])
def test_large_cluster_partial_syncs_read_the_kernel_once_a_period_on_legacy_never_on_nft(backend, saves,
                                                                                          monkeypatch):
    """kube-proxy's large-cluster rule (stale chains looked for once per sync period); on the
    nf_tables backend iptables-nft-save takes ~10 s at 10,000 Services, so only full syncs read."""
    from clusterdns.proxy import iptables
    monkeypatch.setattr(iptables, "LARGE_CLUSTER_ENDPOINTS", 0)     # the demo counts as large
    cfg = cfg_of("--proxy-mode", "iptables")
    runner = RecordingRunner()
    ipt = px.IptablesBackend(runner, cfg, 4)
    ipt.exe.backend = backend
    state = StateStore()
    publish(state, demo_records())

    async def go():
        await ipt.sync(state.current, None, 0.0)
        assert sum("-save" in a[0] for a, _ in runner.calls) == 2      # nat and filter
        assert ipt.large
        runner.calls.clear()
        key = next(iter(state.current.services))
        await ipt.sync(state.current, {key}, 1.0)           # within the period: no read
        await ipt.sync(state.current, {key}, 1.0 + cfg.proxy.sync_period)
        return sum("-save" in a[0] for a, _ in runner.calls)

    assert asyncio.run(go()) == 2 * saves


async def test_a_change_after_the_first_sync_does_not_wait_for_the_leftovers_dump():
    """Removing what other modes left starts with iptables-save of every table (~9 s on
    iptables-nft at 10,000 Services): a change made meanwhile is synced before it ends, and
    a chain that sync makes is not taken for a leftover; wait_synced() waits for it."""
    release = asyncio.Event()
    dumps = []
    foreign = ("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-IPVS-LEFT - [0:0]\n:KUBE-SEP-MADEMEANWHILE - [0:0]\n"
               "-A KUBE-SERVICES -j KUBE-SEP-MADEMEANWHILE\nCOMMIT\n")

    class SlowSave(RecordingRunner):
        async def run(self, argv, stdin=None):
            argv = tuple(argv)
            if argv == ("iptables-nft-save",) and rig.proxier.syncs:     # (not the backend's choice)
                dumps.append(argv)
                await release.wait()
                self.calls.append((argv, stdin))
                return Result(argv, 0, foreign)
            return await super().run(argv, stdin)

    rig = Rig(cfg_of())
    rig.runner = SlowSave()
    rig.proxier = px.Proxier(rig.proxier.cfg, rig.store, executor=rig.runner)
    async with rig:
        for _ in range(100):
            if dumps:
                break
            await asyncio.sleep(0.01)
        assert dumps and rig.proxier.syncs == 1
        backend = rig.proxier.backends[4]
        sl = rig.store.current.slices[("kube-system", "kube-dns-7fz8q")]
        rig.store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=sl.endpoints[:1]))
        for _ in range(200):
            if rig.proxier.applied_version == rig.store.current.version:
                break
            await asyncio.sleep(0.01)
        assert rig.proxier.applied_version == rig.store.current.version and rig.proxier.syncs == 2
        waiter = asyncio.create_task(rig.proxier.wait_synced(0, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        # a chain the sync meanwhile uses (here: pretend the last one declared it)
        backend.previous = dataclasses.replace(backend.previous, chains={
            **backend.previous.chains, "nat": backend.previous.chains["nat"] | {"KUBE-SEP-MADEMEANWHILE"}})
        release.set()
        assert await waiter
        cleanup = [s for a, s in restores(rig.runner) if s and "KUBE-IPVS-LEFT" in s]
        assert cleanup and "-X KUBE-IPVS-LEFT" in cleanup[0] and "KUBE-SEP-MADEMEANWHILE" not in cleanup[0]
