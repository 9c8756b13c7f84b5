"""Switching proxy modes in a real kernel (a namespace): the first full sync of the new mode
removes what the other modes left (clusterdns's or kube-proxy's: same names), and nothing else."""
from __future__ import annotations

import asyncio

import pytest

from clusterdns.config import load
from clusterdns.proxy import iptables, ipvs
from clusterdns.proxy import proxier as px
from clusterdns.proxy.apply import SubprocessRunner
from clusterdns.sources.manifest import DEMO_MANIFEST, publish
from clusterdns.state import StateStore
from tests.demo import demo_records, demo_state
from tests.nslib import requires, run, sh

pytestmark = [pytest.mark.root, requires("nft", "iptables-nft-restore", "iptables-legacy-restore")]

BASE = ["proxy", "--manifest", DEMO_MANIFEST, "--node-ip", "192.168.49.2", "--node-name", "node-a",
        "--cluster-cidr", "10.161.0.0/16", "--min-sync-period", "0", "--apply"]


async def sync_once(ns: str, mode: str) -> px.Proxier:
    """One proxier in `mode` against the namespace's kernel: its first (full) sync, then stop."""
    cfg = load(BASE + ["--proxy-mode", mode], env={})
    store = StateStore()
    proxier = px.Proxier(cfg, store, executor=SubprocessRunner(prefix=("ip", "netns", "exec", ns)))
    publish(store, demo_records())
    task = asyncio.create_task(proxier.run())
    try:
        assert await proxier.wait_synced(timeout=60), proxier.last_error
    finally:
        await proxier.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return proxier


def kube_chains(ns: str, tool: str) -> list[str]:
    out = run(tool, ns=ns).stdout
    return sorted(line.split()[0][1:] for line in out.splitlines() if line.startswith(":KUBE-"))


def kube_rules(ns: str, tool: str) -> list[str]:
    return [line for line in run(tool, ns=ns).stdout.splitlines() if line.startswith("-A ") and "KUBE-" in line]


def nft_tables(ns: str) -> str:
    return sh("nft", "list", "tables", ns=ns)


FOREIGN = ("*filter\n:FOREIGN - [0:0]\n-A INPUT -p tcp --dport 9999 -j FOREIGN\n-A FOREIGN -j ACCEPT\nCOMMIT\n"
           "*nat\n-A PREROUTING -p tcp --dport 9998 -j REDIRECT --to-ports 9997\nCOMMIT\n")


def foreign_rules(ns: str, tool: str) -> list[str]:
    return [line for line in run(tool, ns=ns).stdout.splitlines() if "--dport 999" in line or "FOREIGN" in line]


async def test_nftables_to_iptables(netns):
    await sync_once(netns, "nftables")
    assert "table ip kube-proxy" in nft_tables(netns)
    sh("nft", "add table inet foreign", ns=netns)
    await sync_once(netns, "iptables")
    tables = nft_tables(netns)
    assert "kube-proxy" not in tables and "table inet foreign" in tables
    assert "KUBE-SERVICES" in kube_chains(netns, "iptables-nft-save")


async def test_iptables_to_nftables_cleans_both_backends(netns):
    await sync_once(netns, "iptables")
    assert "KUBE-SERVICES" in kube_chains(netns, "iptables-nft-save")
    # kube-proxy's chains in the other backend too (as a node that ran it with iptables-legacy)
    legacy = iptables.render(demo_state(), load(BASE, env={}), 4).text
    sh("iptables-legacy-restore", "--noflush", ns=netns, input=legacy)
    for tool in ("iptables-nft-restore", "iptables-legacy-restore"):
        sh(tool, "--noflush", ns=netns, input=FOREIGN)
    foreign = {tool: foreign_rules(netns, tool) for tool in ("iptables-nft-save", "iptables-legacy-save")}
    assert all(len(v) == 4 for v in foreign.values()), foreign

    await sync_once(netns, "nftables")
    assert "table ip kube-proxy" in nft_tables(netns)
    for tool in ("iptables-nft-save", "iptables-legacy-save"):
        assert kube_chains(netns, tool) == [] and kube_rules(netns, tool) == [], tool
        assert foreign_rules(netns, tool) == foreign[tool]         # other rules untouched


@requires("ipset")
async def test_iptables_removes_ipvs_leftovers_in_its_own_tables(netns):
    """What IPVS mode leaves beside the kernel's IPVS table: kube-ipvs0, KUBE-* ipsets and its
    iptables chains and jumps (here written into the nft backend, which iptables mode then uses)."""
    cfg = load(BASE + ["--proxy-mode", "ipvs"], env={})
    config = ipvs.render(demo_state(), cfg, 4)
    sh("ipset", "restore", "-exist", ns=netns, input=config.ipsets)
    sh("ip", "link", "add", "kube-ipvs0", "type", "bridge", ns=netns)
    sh("ip", "addr", "add", f"{config.addresses[0]}/32", "dev", "kube-ipvs0", ns=netns)
    sh("iptables-nft-restore", "--noflush", ns=netns, input=config.iptables)
    sh("iptables-nft-restore", "--noflush", ns=netns, input=FOREIGN)
    assert "KUBE-IPVS-FILTER" in kube_chains(netns, "iptables-nft-save")

    proxier = await sync_once(netns, "iptables")
    chains = set(kube_chains(netns, "iptables-nft-save"))
    assert chains == set().union(*proxier.backends[4].kept.values())   # exactly what the sync wrote
    assert not chains & {"KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
                         "KUBE-SOURCE-RANGES-FIREWALL"}
    jumps = [r for r in kube_rules(netns, "iptables-nft-save") if r.split()[1] in
             ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING")]
    wanted = {f"-A {chain} {spec}" for _, chain, spec in iptables.jump_rules(cfg, 4)}
    assert set(jumps) <= wanted and len(jumps) == len(set(jumps))
    assert run("ip", "link", "show", "kube-ipvs0", ns=netns).returncode != 0
    assert not [s for s in sh("ipset", "list", "-n", ns=netns).split() if s.startswith("KUBE-")]
    assert len(foreign_rules(netns, "iptables-nft-save")) == 4
