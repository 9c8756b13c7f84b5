"""Renders remember per-Service work across calls in caches their callers own (the
backends): the output must never depend on it.

Each test compares a render made with warm caches against one made from
scratch (no cache, records rebuilt as fresh objects).
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from clusterdns.config import Config
from clusterdns.model import Service, ServicePort
from clusterdns.proxy import iptables, ipvs, nftables, servicemap
from clusterdns.proxy.nftobj import text as ops_text
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore, state_from_records
from clusterdns.synthetic import synthetic_records
from tests.common import endpoint_slots, nft_elements
from tests.demo import DEMO_CFG, demo_state

CFG = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
def synthetic_state():
    """Fresh objects on every call: ClusterIP and NodePort Services, headless ones, local endpoints."""
    return state_from_records(synthetic_records(60, 4, headless_every=7, nodeport_every=3))


# what the backends own across their renders
IPT_CACHE = iptables.RenderCache()
NFT_CACHE = nftables.RenderCache()
PORTS_CACHE = servicemap.PortsCache()


def ipt(st, cfg, fam=4, **kw):
    return iptables.render(st, cfg, fam, cache=IPT_CACHE, **kw)


def cold(fn):
    """fn's result from empty caches; the module's caches are new afterwards too."""
    for c in (IPT_CACHE, NFT_CACHE, PORTS_CACHE):
        c.__init__()
    return fn()


RENDERS = {
    "iptables": lambda st, cfg, fam: ipt(st, cfg, fam).text,
    "iptables-nojumps": lambda st, cfg, fam: ipt(st, cfg, fam, jumps=False).text,
    "nftables": lambda st, cfg, fam: nftables.render(st, cfg, fam, cache=NFT_CACHE).text,
    "ipvs": lambda st, cfg, fam: repr(ipvs.render(st, cfg, fam, cache=PORTS_CACHE)),
    "service_ports": lambda st, cfg, fam: repr(servicemap.service_ports(st, cfg, fam, PORTS_CACHE)),
}


@pytest.mark.parametrize("what", sorted(RENDERS))
@pytest.mark.parametrize("case", ["synthetic", "demo4", "demo6"])
def test_warm_render_equals_cold_render(what, case):
    make, cfg, fam = {"synthetic": (synthetic_state, CFG, 4), "demo4": (demo_state, DEMO_CFG, 4),
                      "demo6": (demo_state, DEMO_CFG, 6)}[case]
    render = RENDERS[what]
    reference = cold(lambda: render(make(), cfg, fam))
    st = make()
    first = render(st, cfg, fam)          # fills the caches from these objects
    again = render(st, cfg, fam)          # served from them
    fresh = render(make(), cfg, fam)      # equal content, new objects: nothing reused wrongly
    assert first == reference
    assert again == reference
    assert fresh == reference


def test_changed_slice_is_rendered_again():
    store = StateStore()
    publish(store, synthetic_records(30, 3))
    before = store.current
    key = sorted(before.slices)[7]
    sl = before.slices[key]
    eps = list(sl.endpoints)
    eps[0] = dataclasses.replace(eps[0], addresses=("10.250.0.1",))
    store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=tuple(eps)))
    after = store.current

    ipt(before, CFG)
    nft_before = nftables.render(before, CFG, 4)
    warm = ipt(after, CFG).text
    assert "10.250.0.1" in warm
    assert warm == cold(lambda: ipt(after, CFG).text)
    # a partial sync of the changed Service, with warm and with cold caches
    ipt(before, CFG)
    warm_only = ipt(after, CFG, only={sl.service_key})
    cold_only = cold(lambda: ipt(after, CFG, only={sl.service_key}))
    assert warm_only == cold_only
    assert "10.250.0.1" in warm_only.text
    # nftables: full text, and the one-Service change from the previous state
    nftables.render(before, CFG, 4, cache=NFT_CACHE)
    warm_change = nftables.render(after, CFG, 4, previous=nft_before.state, changed={sl.service_key},
                                  cache=NFT_CACHE)
    cold_change = cold(lambda: nftables.render(after, CFG, 4, previous=nft_before.state,
                                               changed={sl.service_key}, cache=NFT_CACHE))
    assert warm_change.text == cold_change.text and "10.250.0.1" in warm_change.text
    assert warm_change.state.chains == cold_change.state.chains
    assert nftables.render(after, CFG, 4, cache=NFT_CACHE).text == cold(lambda: nftables.render(after, CFG, 4).text)


def test_changed_service_and_context_are_rendered_again():
    store = StateStore()
    publish(store, synthetic_records(20, 2))
    before = store.current
    svc = before.services[("ns-3", "svc-3")]
    store.upsert("Service", replace(svc, ports=(ServicePort("http", "TCP", 81, 0, 8080),)))
    after = store.current
    for render in (lambda st, cfg: ipt(st, cfg).text,
                   lambda st, cfg: nftables.render(st, cfg, 4, cache=NFT_CACHE).text):
        render(before, CFG)
        assert render(after, CFG) == cold(lambda: render(after, CFG))
        # everything besides the Service that its rules depend on: masquerade-all, cluster CIDR, node
        for cfg in (CFG.with_options(masquerade_all=True), CFG.with_options(cluster_cidrs=("10.1.0.0/16",)),
                    CFG.with_options(node_name="node-1", node_ips=("192.168.0.3",)), CFG):
            warm = render(after, cfg)
            assert warm == cold(lambda: render(after, cfg))


def test_large_cluster_switch_is_seen():
    # the endpoint comments go when the cluster becomes large: blocks cached while it was small
    # (the same Service and slice objects) must not be reused
    records = synthetic_records(101, 10)
    last = ("ns-0", "svc-100")

    def is_last(rec):
        kind, r = rec
        return kind in ("Service", "EndpointSlice") and (r.namespace, getattr(r, "service", r.name)) == last

    store = StateStore()
    publish(store, [r for r in records if not is_last(r)])
    small = store.current
    small_text = cold(lambda: ipt(small, CFG).text)
    assert '-m comment --comment "ns-1/svc-1:http -> ' in small_text
    for kind, rec in records:
        if is_last((kind, rec)):
            store.upsert(kind, rec)
    large = store.current
    warm = ipt(large, CFG).text
    assert "ns-1/svc-1:http -> " not in warm
    assert warm == cold(lambda: ipt(large, CFG).text)
    assert ipt(small, CFG).text == small_text


def test_caches_hold_only_the_current_services():
    ipt_cache = iptables.RenderCache()     # the caches belong to their caller (the backend)
    nft_cache = nftables.RenderCache()
    iptables.render(state_from_records(synthetic_records(50, 1)), CFG, 4, cache=ipt_cache)
    nftables.render(state_from_records(synthetic_records(50, 1)), CFG, 4, cache=nft_cache)
    assert len(nft_cache.entries) == 50 and len(nft_cache.ports.entries) == 50
    assert len(ipt_cache.entries) >= 50 and len(ipt_cache.ports.entries) == 50
    st = state_from_records(synthetic_records(5, 1))
    iptables.render(st, CFG, 4, cache=ipt_cache)
    nftables.render(st, CFG, 4, cache=nft_cache)
    assert len(ipt_cache.ports.entries) == 5 and 5 <= len(ipt_cache.entries) < 50
    assert len(nft_cache.entries) == 5 and len(nft_cache.ports.entries) == 5


def test_a_targeted_render_drops_the_full_renders_entries_of_what_it_changed():
    """Kept, a changed Service's entry held its first objects beside the new ones until the
    next full render (the hourly resync): ~5 KB per Service changed at 10,000 x 10."""
    store = StateStore()
    publish(store, synthetic_records(40, 3))
    cache = nftables.RenderCache()
    first = nftables.render(store.current, CFG, 4, cache=cache)
    key = ("ns-3", "svc-3")
    sl = store.current.slices_for(*key)[0]
    eps = list(sl.endpoints)
    eps[0] = replace(eps[0], addresses=("10.252.0.1",))
    store.upsert("EndpointSlice", replace(sl, endpoints=tuple(eps)))
    rs = nftables.render(store.current, CFG, 4, previous=first.state, changed={key}, cache=cache)
    assert not rs.full and "10.252.0.1" in rs.text
    assert key not in cache.entries and len(cache.entries) == 39
    # the next full render builds it again, as from scratch
    again = nftables.render(store.current, CFG, 4, previous=rs.state, resync=True, cache=cache)
    anew = nftables.render(store.current, CFG, 4, previous=rs.state, resync=True)
    assert ops_text(again.ops, 4) == ops_text(anew.ops, 4) and key in cache.entries


def test_renderers_do_not_share_cache_state():
    """Two owners' caches are independent: one's renders neither fill nor serve the other's,
    and a render without a cache leaves nothing behind."""
    st = synthetic_state()
    a, b = iptables.RenderCache(), iptables.RenderCache()
    iptables.render(st, CFG, 4)
    assert not a.entries and not a.ports.entries
    first = iptables.render(st, CFG, 4, cache=a)
    assert a.entries and not b.entries and not b.ports.entries
    # the same state and node through b: b builds its own pairs and blocks, none of a's
    assert iptables.render(st, CFG, 4, cache=b).text == first.text
    assert a.entries.keys() == b.entries.keys()
    assert all(a.entries[k][0] is not b.entries[k][0] and a.entries[k][1] is not b.entries[k][1]
               for k in a.entries)
    # b renders another node's rules; a still holds (and serves) its own
    iptables.render(st, CFG.with_options(node_name="node-1", node_ips=("192.168.0.3",)), 4, cache=b)
    assert a.context != b.context and a.ports.context != b.ports.context
    held = dict(a.entries)
    assert iptables.render(st, CFG, 4, cache=a).text == first.text
    assert all(a.entries[k][1] is held[k][1] for k in held)   # every block served, none rebuilt
    n1, n2 = nftables.RenderCache(), nftables.RenderCache()
    nftables.render(st, CFG, 4, cache=n1)
    assert n1.entries and not n2.entries and not n2.ports.entries


def test_headless_and_removed_services():
    st = synthetic_state()
    ipt(st, CFG)
    records = [("Service", s) for k, s in st.services.items() if k != ("ns-1", "svc-1")]
    records += [("EndpointSlice", s) for s in st.slices.values()]
    records.append(("Service", Service("ns-0", "extra", "ClusterIP", ("10.96.9.9",),
                                       ports=(ServicePort("http", "TCP", 80, 0, 8080),))))
    smaller = state_from_records(records)
    warm = ipt(smaller, CFG).text
    assert "ns-1/svc-1:http" not in warm and "ns-0/extra:http has no endpoints" in warm
    assert warm == cold(lambda: ipt(smaller, CFG).text)


def test_unchanged_services_are_looked_up_not_rebuilt():
    """A render after a change rebuilds the changed Service's ports only; the others are the
    objects of the previous render (bench/proxy/render_cache.py measures what that saves)."""
    store = StateStore()
    publish(store, synthetic_records(60, 4, headless_every=7, nodeport_every=3))
    cache = servicemap.PortsCache()
    first = {info.name: (info, cat) for info, cat in servicemap.service_ports(store.current, CFG, 4, cache)}
    again = {info.name: (info, cat) for info, cat in servicemap.service_ports(store.current, CFG, 4, cache)}
    assert len(first) > 50 and first.keys() == again.keys()
    assert all(again[k][0] is first[k][0] and again[k][1] is first[k][1] for k in first)
    svc = store.current.services[("ns-1", "svc-1")]
    store.upsert("Service", replace(svc, ports=svc.ports + (ServicePort("extra", "TCP", 81, 0, 8081),)))
    after = {info.name: (info, cat) for info, cat in servicemap.service_ports(store.current, CFG, 4, cache)}
    rebuilt = {k for k in first if k in after and after[k][0] is not first[k][0]}
    assert rebuilt == {k for k in first if k.startswith("ns-1/svc-1:")}
    assert "ns-1/svc-1:extra" in after and len(after) == len(first) + 1


def test_service_port_info_sets_every_field():
    # service_port_infos fills the instance dict directly (speed): a field added to the
    # dataclass must be set there too
    svc = Service("ns", "web", "LoadBalancer", ("10.96.0.5",), ports=(ServicePort("http", "TCP", 80, 30080, 8080),),
                  lb_ips=("192.0.2.9",), lb_source_ranges=("198.51.100.0/24",), external_local=True,
                  affinity_timeout=30, health_check_node_port=32000)
    info = servicemap.service_port_infos(svc, 4)[0]
    fields = [f.name for f in dataclasses.fields(servicemap.ServicePortInfo)]
    assert sorted(vars(info)) == sorted(fields)
    same = servicemap.ServicePortInfo(**{f: getattr(info, f) for f in fields})
    assert info == same and hash(info) == hash(same) and repr(info) == repr(same)
    assert info.external_local and info.lb_firewall and info.node_port == 30080


def test_layered_mapping_behaves_as_a_dict_copy():
    import random

    from clusterdns.proxy.nftables import _Layered
    rnd = random.Random(7)
    ref: dict = {f"k{i}": i for i in range(300)}
    cur = dict(ref)
    flattened = 0
    for step in range(400):
        layer = _Layered.derive(cur)
        ref = dict(ref)
        for _ in range(rnd.randint(1, 12)):
            key = f"k{rnd.randint(0, 420)}"
            if rnd.random() < 0.45:
                assert layer.pop(key, "none") == ref.pop(key, "none")
            else:
                layer[key] = ref[key] = step
        cur = layer.settled()
        flattened += isinstance(cur, dict)
        assert list(cur.items()) == list(ref.items())
        assert len(cur) == len(ref) and cur == ref
        probe = f"k{rnd.randint(0, 420)}"
        assert (probe in cur) == (probe in ref) and cur.get(probe) == ref.get(probe)
    assert flattened  # the layers were flattened along the way, and still equal


def test_chained_changes_equal_a_full_build():
    # the proxier chains `changed=` renders, each from the last one's state
    store = StateStore()
    publish(store, synthetic_records(120, 3, nodeport_every=5))
    first = nftables.render(store.current, CFG, 4)
    prev = first.state
    slices = sorted(store.current.slices)
    for i in range(150):
        sl = store.current.slices[slices[(i * 37) % len(slices)]]
        eps = list(sl.endpoints)
        eps[i % len(eps)] = dataclasses.replace(eps[i % len(eps)], addresses=(f"10.251.{i // 200}.{i % 200 + 1}",))
        store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=tuple(eps)))
        rs = nftables.render(store.current, CFG, 4, previous=prev, changed={sl.service_key})
        assert rs.text and not rs.full
        prev = rs.state
    full = cold(lambda: nftables.build(store.current, CFG, 4))
    assert dict(prev.chains) == dict(full.chains)
    assert dict(prev.chain_decls) == dict(full.chain_decls) and dict(prev.sets) == dict(full.sets)
    assert nft_elements(prev) == nft_elements(full)
    # what differs is who holds which share of a slot (replaced endpoints keep their places)
    assert {(op.kind, op.name[:len("endpoints-")]) for op in nftables.diff_ops(prev, full)} <= {
        ("element", "endpoints-")}
    def statements(text):   # one per element: element statements group a set's elements
        out = []
        for line in text.splitlines():
            head, sep, body = line.partition(" { ")
            if line.startswith("add element ip kube-proxy endpoints-"):
                out += [f"{head} {slot}" for slot in endpoint_slots(body[:-2].split(", "))]
            else:
                out += [f"{head} {{ {e} }}" for e in body[:-2].split(", ")] if line.startswith("add element") else [line]
        return sorted(out)
    assert statements(ops_text(nftables.full_ops(prev), 4)) == statements(ops_text(nftables.full_ops(full), 4))


def test_a_resync_of_an_unchanged_cluster_keeps_the_previous_state():
    """A periodic resync whose Services are all the same objects builds no second table state;
    its transaction is the one a state built anew gives."""
    store = StateStore()
    publish(store, synthetic_records(60, 3, nodeport_every=4))
    cache = nftables.RenderCache()
    first = nftables.render(store.current, CFG, 4, cache=cache)
    again = nftables.render(store.current, CFG, 4, previous=first.state, resync=True, cache=cache)
    assert again.state is first.state
    anew = nftables.render(store.current, CFG, 4, previous=first.state, resync=True)
    assert anew.state is not first.state
    assert ops_text(again.ops, 4) == ops_text(anew.ops, 4)
    # one Service changed: a new state, equal to a full build
    svc = store.current.services[("ns-3", "svc-3")]
    store.upsert("Service", replace(svc, ports=(replace(svc.ports[0], port=81),)))
    changed = nftables.render(store.current, CFG, 4, previous=first.state, resync=True, cache=cache)
    full = nftables.render(store.current, CFG, 4)
    assert changed.state is not first.state
    assert nft_elements(changed.state) == nft_elements(full.state)
    assert dict(changed.state.chains) == dict(full.state.chains)
