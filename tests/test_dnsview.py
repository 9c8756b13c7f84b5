"""DnsView restart adoption: what the kernel held at start counts as applied until the first sync."""
from clusterdns.dnsview import DnsView
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.state import StateStore
from tests.common import shown_eps, shown_ips

HTTP = ServicePort("http", "TCP", 80)
DNS = ServicePort("dns", "UDP", 53)


def svc(name, *ips, ports=(HTTP,)):
    return Service("ns", name, cluster_ips=ips, ports=ports)


def eps(name, *ips):
    return EndpointSlice("ns", f"{name}-1", name, "IPv4", tuple(Endpoint((ip,)) for ip in ips),
                         (EndpointPort("http", "TCP", 8080), EndpointPort("dns", "UDP", 53)))


def listed(store, services, slices):
    store.replace("Service", services)
    store.replace("EndpointSlice", slices)


KERNEL = {
    ("10.96.0.5", "tcp", 80): {"10.0.0.1:8080", "10.0.0.2:8080"},     # protocol case does not matter
    ("10.96.0.6", "TCP", 80): {"10.0.0.3:8080"},
    ("10.96.0.7", "TCP", 80): {"10.0.0.4:8080"},
    ("10.96.0.8", "TCP", 80): set(),                                   # no endpoints: REJECT
    ("10.96.0.9", "TCP", 80): {"10.0.0.9:8080"},
}


def test_adopted_services_answer_before_the_first_sync():
    store = StateStore()
    view = DnsView(store)
    listed(store, [svc("same", "10.96.0.5"),
                   svc("moved", "10.96.0.66"),                        # ClusterIP changed while down
                   svc("more-ports", "10.96.0.7", ports=(HTTP, DNS)),  # a port added while down
                   svc("empty", "10.96.0.8"),
                   svc("new", "10.96.0.10")],                         # created while down
           [eps("same", "10.0.0.1", "10.0.0.5"),                      # 10.0.0.2 gone, .5 new
            eps("empty")])
    assert shown_ips(view, "same") is None                                # nothing known yet
    assert view.adopt(KERNEL, families=(4,)) == 2
    assert view.adopted == 2 and view.adopting
    assert shown_ips(view, "same") == ("10.96.0.5",)
    assert shown_eps(view, "same") == ["10.0.0.1"]      # only endpoints in both kernel and state
    assert shown_ips(view, "empty") == ("10.96.0.8",)
    for name in ("moved", "more-ports", "new"):
        assert shown_ips(view, name) is None                # wait for the first sync
    assert view.current.synced == frozenset()           # unknown names stay SERVFAIL

    # Changes before the first sync are judged against the kernel too.
    store.upsert("Service", svc("same", "10.96.0.55"))
    assert shown_ips(view, "same") is None                  # its new address is not in the kernel
    store.upsert("Service", svc("same", "10.96.0.5"))
    assert shown_ips(view, "same") == ("10.96.0.5",)
    store.delete("Service", ("ns", "empty"))
    assert shown_ips(view, "empty") is None and view.adopted == 1

    # The first sync replaces adoption: P decides, for every Service.
    view.applied(store.current.version)
    assert not view.adopting and view.adopted == 0
    assert shown_ips(view, "moved") == ("10.96.0.66",) and shown_ips(view, "new") == ("10.96.0.10",)
    assert shown_eps(view, "same") == ["10.0.0.1", "10.0.0.5"]
    assert view.current.is_synced("Service", "EndpointSlice")


def test_adopt_before_the_state_is_listed():
    store = StateStore()
    view = DnsView(store)
    view.adopt(KERNEL, families=(4,))
    assert view.adopting and view.adopted == 0
    listed(store, [svc("same", "10.96.0.5")], [eps("same", "10.0.0.2")])
    assert shown_ips(view, "same") == ("10.96.0.5",) and shown_eps(view, "same") == ["10.0.0.2"]


def test_adopt_ignored_after_a_sync_and_in_follow_mode():
    store = StateStore()
    view = DnsView(store)
    listed(store, [svc("new", "10.96.0.10")], [])
    view.applied(store.current.version)
    store.upsert("Service", svc("b", "10.96.0.9"))
    assert view.adopt(KERNEL) == 0 and not view.adopting
    assert shown_ips(view, "b") is None                     # waits for its sync, whatever the kernel says
    follow = DnsView(StateStore(), follow=True)
    assert follow.adopt(KERNEL) == 0 and not follow.adopting


def test_families_not_programmed_are_not_looked_for():
    store = StateStore()
    view = DnsView(store)
    listed(store, [svc("dual", "10.96.0.9", "fd00:96::9")], [])
    view.adopt(KERNEL, families=(4, 6))
    assert shown_ips(view, "dual") is None                  # the IPv6 proxier has nothing for it
    view2 = DnsView(store)
    view2.adopt({**KERNEL, ("fd00:96:0::9", "TCP", 80): {"[fd00::1]:8080"}}, families=(4, 6))
    assert shown_ips(view2, "dual") == ("10.96.0.9", "fd00:96::9")   # addresses compared canonically
    view3 = DnsView(store)
    view3.adopt(KERNEL, families=(4,))
    assert shown_ips(view3, "dual") == ("10.96.0.9", "fd00:96::9")


def test_unreadable_kernel_entries_are_skipped():
    store = StateStore()
    view = DnsView(store)
    listed(store, [svc("same", "10.96.0.5")], [eps("same", "10.0.0.1")])
    view.adopt({("not-an-ip", "TCP", 80): {"x"}, ("10.96.0.5", "TCP", 80): {"garbage", "10.0.0.1:8080"}})
    assert shown_ips(view, "same") == ("10.96.0.5",) and shown_eps(view, "same") == ["10.0.0.1"]


def test_slices_by_service_kept_per_change_matches_a_rebuild():
    """The view keeps its per-Service slice index as changes come (no full rebuild per
    change); after every step it equals the index rebuilt from the view's slices."""
    from clusterdns.state import ClusterState
    store = StateStore()
    view = DnsView(store)

    def check():
        cur = view.current
        assert dict(cur.slices_by_service) == dict(ClusterState(slices=cur.slices).slices_by_service)

    listed(store, [svc("a", "10.96.0.5"), svc("b", "10.96.0.6"), svc("h", "None")],
           [eps("a", "10.0.0.1"), eps("b", "10.0.0.2")])
    check()
    view.applied(store.current.version)
    check()
    assert [sl.name for sl in view.current.slices_for("ns", "a")] == ["a-1"]
    # a second slice sorts before the first; a slice of a Service that is not applied yet
    store.upsert("EndpointSlice", EndpointSlice("ns", "a-0", "a", "IPv4", (Endpoint(("10.0.0.3",)),),
                                                (EndpointPort("http", "TCP", 8080),)))
    store.upsert("Service", svc("c", "10.96.0.7"))
    store.upsert("EndpointSlice", eps("c", "10.0.0.4"))
    check()
    view.applied(store.current.version)
    check()
    assert [sl.name for sl in view.current.slices_for("ns", "a")] == ["a-0", "a-1"]
    assert view.current.slices_for("ns", "c")
    store.delete("EndpointSlice", ("ns", "a-1"))
    store.delete("Service", ("ns", "b"))
    check()
    assert [sl.name for sl in view.current.slices_for("ns", "a")] == ["a-0"]
    assert view.current.slices_for("ns", "b") == ()
    store.replace("EndpointSlice", [eps("c", "10.0.0.9")])     # a relist
    view.applied(store.current.version)
    check()
    assert view.current.slices_for("ns", "a") == ()


def test_ports_first_then_their_endpoints():
    """A restart reads the ports alone first (None: endpoints not read): the Service answers
    without ready endpoints until they are read, never with one the kernel does not route to."""
    store = StateStore()
    view = DnsView(store)
    view.adopt(dict.fromkeys(KERNEL), families=(4,))
    listed(store, [svc("same", "10.96.0.5"), svc("moved", "10.96.0.66")],
           [eps("same", "10.0.0.1", "10.0.0.5")])
    assert shown_ips(view, "same") == ("10.96.0.5",) and shown_eps(view, "same") == []
    assert shown_ips(view, "moved") is None and view.adopted == 1
    assert view.adopt({**dict.fromkeys(KERNEL), **KERNEL}, families=(4,)) == 1
    assert shown_eps(view, "same") == ["10.0.0.1"]          # in both the kernel and the state
    # a port whose endpoints were not read keeps the Service without them
    view.adopt({**KERNEL, ("10.96.0.5", "TCP", 80): None}, families=(4,))
    assert shown_ips(view, "same") == ("10.96.0.5",) and shown_eps(view, "same") == []
    view.applied(store.current.version)
    assert shown_eps(view, "same") == ["10.0.0.1", "10.0.0.5"]
