"""iptables partial syncs write only what changed: after each of many random changes applied as a
partial sync, the kernel's tables equal a fresh full render's (real iptables, two namespaces)."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from clusterdns.config import Config
from clusterdns.model import (
    LOAD_BALANCER,
    NODE_PORT,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Namespace,
    Service,
    ServicePort,
)
from clusterdns.proxy import iptables, iptsave
from clusterdns.proxy.apply import SubprocessRunner
from clusterdns.proxy.proxier import IptablesBackend
from clusterdns.state import state_from_records
from tests.nslib import requires, sh

CFG = Config.from_options(node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",))
# Top-level chains hold one rule per service port in no particular order (kube-proxy's
# order is its map's): compared as sets. Every other chain's order matters.
UNORDERED = {("nat", "KUBE-SERVICES"), ("nat", "KUBE-NODEPORTS"), ("filter", "KUBE-SERVICES"),
             ("filter", "KUBE-EXTERNAL-SERVICES"), ("filter", "KUBE-NODEPORTS"), ("filter", "KUBE-PROXY-FIREWALL")}


def service(i: int, rng: random.Random) -> Service:
    kind = rng.choice(["ClusterIP", "ClusterIP", NODE_PORT, LOAD_BALANCER])
    ports = [ServicePort("http", "TCP", 80 + rng.randrange(3), node_port=30000 + i if kind != "ClusterIP" else 0)]
    if rng.random() < 0.3:
        ports.append(ServicePort("dns", "UDP", 53, node_port=31000 + i if kind != "ClusterIP" else 0))
    return Service("ns", f"s{i}", kind, (f"10.96.{rng.randrange(2)}.{i + 1}",), ports=tuple(ports),
                   external_ips=("192.0.2.9",) if rng.random() < 0.2 else (),
                   lb_ips=(f"203.0.113.{i + 1}",) if kind == LOAD_BALANCER else (),
                   lb_source_ranges=("198.51.100.0/24",) if kind == LOAD_BALANCER and rng.random() < 0.5 else (),
                   external_local=kind != "ClusterIP" and rng.random() < 0.4,
                   internal_local=rng.random() < 0.15,
                   affinity_timeout=600 if rng.random() < 0.2 else 0)


def endpoints(i: int, rng: random.Random) -> EndpointSlice:
    eps = tuple(Endpoint((f"10.161.{i}.{j}",), ready=rng.random() < 0.85, serving=True,
                         terminating=rng.random() < 0.1, node_name=rng.choice(["node-a", "node-b"]))
                for j in rng.sample(range(1, 9), rng.randrange(0, 5)))
    return EndpointSlice("ns", f"s{i}-1", f"s{i}", "IPv4", eps,
                         (EndpointPort("http", "TCP", 8080), EndpointPort("dns", "UDP", 5353)))


def state_of(services: dict, slices: dict):
    recs = [("Namespace", Namespace("ns"))]
    recs += [("Service", s) for s in services.values()]
    recs += [("EndpointSlice", s) for s in slices.values()]
    return state_from_records(recs)


def tables(ns: str, tool: str) -> dict:
    out = {}
    for name, t in iptsave.read(sh(tool, ns=ns)).items():
        if name not in ("nat", "filter"):
            continue
        for chain in t.chains:
            rules = [r.spec for r in t.rules if r.chain == chain]
            out[(name, chain)] = sorted(rules) if (name, chain) in UNORDERED else rules
    return out


@pytest.mark.root
@requires("iptables-nft-restore", "iptables-legacy-restore")
@pytest.mark.parametrize("backend", ["legacy", "nft"])
def test_partial_syncs_equal_a_fresh_full_render(namespaces, backend):
    node, fresh = namespaces.add("node"), namespaces.add("fresh")
    rng = random.Random(7)
    services = {i: service(i, rng) for i in range(12)}
    slices = {i: endpoints(i, rng) for i in range(12)}
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", node)), CFG, 4)
    ipt.exe.backend = backend
    save, restore = f"iptables-{backend}-save", f"iptables-{backend}-restore"
    written = []

    async def go():
        await ipt.sync(state_of(services, slices), None, 0.0)
        for step in range(40):
            i = rng.randrange(14)
            what = rng.choice(["endpoints", "endpoints", "service", "delete", "create"])
            if what == "delete":
                services.pop(i, None)
                slices.pop(i, None)
            elif what == "endpoints" and i in services:
                slices[i] = endpoints(i, rng)
            else:
                services[i] = service(i, rng)
                if what == "create" or i not in slices:
                    slices[i] = endpoints(i, rng)
            state = state_of(services, slices)
            await ipt.sync(state, {("ns", f"s{i}")}, float(step))
            # what kube-proxy's partial sync writes: the top-level chains whole, plus the Service's
            whole = iptables.render(state, CFG, 4, only={("ns", f"s{i}")}).counts
            written.append((ipt.previous.counts, whole))
            # the same state rendered whole into an empty namespace
            sh(restore, ns=fresh, input=iptables.render(state, CFG, 4).text)
            assert tables(node, save) == tables(fresh, save), f"step {step}: {what} s{i}"
            last = [r for r in iptsave.read(sh(save, ns=node))["nat"].rules if r.chain == "KUBE-SERVICES"][-1]
            assert "KUBE-NODEPORTS" in last.spec        # the NodePort rule stays last

    asyncio.run(go())
    # every partial text wrote less than the top-level chains whole
    assert written
    for delta, whole in written:
        assert delta["nat"] < whole["nat"] and delta["filter"] < whole["filter"], (delta, whole)


def test_partial_text_writes_only_the_changed_service():
    rng = random.Random(3)
    services = {i: service(i, rng) for i in range(30)}
    slices = {i: endpoints(i, rng) for i in range(30)}
    before = iptables.render(state_of(services, slices), CFG, 4)
    slices[4] = replace(slices[4], endpoints=slices[4].endpoints + (Endpoint(("10.161.4.200",)),))
    after = iptables.render(state_of(services, slices), CFG, 4, only={("ns", "s4")}, previous=before)
    lines = after.text.splitlines()
    assert not any(line.startswith((":KUBE-SERVICES", ":KUBE-NODEPORTS", ":KUBE-POSTROUTING", ":KUBE-FORWARD"))
                   for line in lines)
    assert all("s4" in line or not line.startswith("-A ") or "KUBE-SEP" in line or "KUBE-MARK-MASQ" in line
               for line in lines), lines
    # nothing changed: nothing to write
    same = iptables.render(state_of(services, slices), CFG, 4, only={("ns", "s9")}, previous=after)
    assert same.text == ""


def test_nf_tables_backend_warned_once_at_scale(caplog):
    from clusterdns.proxy.apply import RecordingRunner
    from clusterdns.synthetic import synthetic_records
    big = state_from_records(synthetic_records(services=1000, endpoints=1))
    small = state_from_records(synthetic_records(services=999, endpoints=1))

    def warnings(backend, state, syncs=2):
        caplog.clear()
        ipt = IptablesBackend(RecordingRunner(), CFG, 4)
        ipt.exe.backend = backend
        for _ in range(syncs):
            asyncio.run(ipt.sync(state, None, 0.0))
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    found = warnings("nft", big)
    assert len(found) == 1 and "1000 Services" in found[0] and "--proxy-mode nftables" in found[0]
    assert warnings("legacy", big) == []
    assert warnings("nft", small) == []


@pytest.mark.parametrize("affinity", [0, 600])
def test_one_endpoint_changed_rewrites_the_service_chain_and_that_endpoints_chain_only(affinity):
    """kube-proxy rewrites every KUBE-SEP chain of a changed Service; the others hold what they
    held (their name is a hash of the endpoint), so only the changed one is written."""
    svc = Service("ns", "big", "ClusterIP", ("10.96.0.10",), ports=(ServicePort("http", "TCP", 80),),
                  affinity_timeout=affinity)
    eps = tuple(Endpoint((f"10.161.0.{j}",), node_name="node-a") for j in range(1, 51))
    sl = EndpointSlice("ns", "big-1", "big", "IPv4", eps, (EndpointPort("http", "TCP", 8080),))
    recs = [("Namespace", Namespace("ns")), ("Service", svc)]
    before = iptables.render(state_from_records(recs + [("EndpointSlice", sl)]), CFG, 4)
    moved = replace(sl, endpoints=eps[:10] + (Endpoint(("10.161.9.9",), node_name="node-a"),) + eps[11:])
    after = iptables.render(state_from_records(recs + [("EndpointSlice", moved)]), CFG, 4,
                            only={("ns", "big")}, previous=replace(before, text=""))
    written = {line.split(" ")[1] for line in after.text.splitlines() if line.startswith("-A ")}
    declared = {line[1:].split(" ")[0] for line in after.text.splitlines() if line.startswith(":")}
    full = iptables.render(state_from_records(recs + [("EndpointSlice", moved)]), CFG, 4)
    new_sep = {c for c in full.chains["nat"] - before.chains["nat"] if c.startswith("KUBE-SEP-")}
    old_sep = {c for c in before.chains["nat"] - full.chains["nat"] if c.startswith("KUBE-SEP-")}
    assert len(new_sep) == len(old_sep) == 1
    svc_chains = {c for c in written if c.startswith("KUBE-SVC-")}
    assert written == svc_chains | new_sep and len(svc_chains) == 1
    assert declared == svc_chains | new_sep | old_sep
    assert f"-X {old_sep.pop()}" in after.text.splitlines()
    # every rule the kernel gets for the new endpoint's chain is the full render's
    sep = new_sep.pop()
    assert [ln for ln in after.text.splitlines() if ln.startswith(f"-A {sep} ")] == \
        [ln for ln in full.text.splitlines() if ln.startswith(f"-A {sep} ")]
