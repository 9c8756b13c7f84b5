"""Service ports, endpoint selection and names: kube-proxy's semantics and its published hashes."""
from __future__ import annotations

from clusterdns.config import Config
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Node, Service, ServicePort
from clusterdns.proxy import names
from clusterdns.proxy.servicemap import node_info, service_ports
from clusterdns.sources.manifest import DEMO_MANIFEST, load_files
from clusterdns.state import state_from_records

CFG = Config.from_options(command="rules", node_name="node-a", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))


def test_iptables_hashes_match_kube_proxy():
    assert names.port_proto_hash("ns1/svc1:p80", "TCP") == "XPGD46QRK7WJZT7O"
    assert names.port_proto_hash("ns2/svc2:p80", "tcp") == "GNZBNJ2PO5MGZ6GT"
    assert names.svc_chain("ns1/svc1:p80", "tcp") == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert names.sep_chain("ns1/svc1:p80", "tcp", "10.180.0.1:80") == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    # well-known names on every kubeadm cluster
    assert names.svc_chain("default/kubernetes:https", "tcp") == "KUBE-SVC-NPX46M4PTMTKRN6Y"
    assert names.svc_chain("kube-system/kube-dns:dns", "udp") == "KUBE-SVC-TCOU7JCQXEZGVUNU"


def test_fast_base32_equals_the_library():
    for text in ("", "a", "ns1/svc1:p80tcp", "x" * 500, "ünïcode"):
        assert names._b32_16(text) == names._b32(text)[:16]


def test_nftables_names_match_kube_proxy():
    assert names.nft_service_chain(names.nft_service_base("ns1", "svc1", "TCP", "p80")) == \
        "service-ULMVA6XW-ns1/svc1/tcp/p80"
    assert names.nft_endpoint_chain(names.nft_endpoint_base("ns1", "svc1", "tcp", "p80", "10.180.0.1", 80)) == \
        "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    assert names.nft_endpoint_base("ns1", "svc1", "tcp", "p80", "fd00:10:180::2:1", 80) == \
        "2CRNCTTE-ns1/svc1/tcp/p80__fd00.10.180..2.1/80"
    long = names.hash_and_truncate("n" * 300)
    assert len(long) == 8 + 1 + 240 and long.endswith("...")


def _state(*endpoints, service=None, slices=None, node_zone="zone-a"):
    svc = service or Service("ns1", "svc1", cluster_ips=("172.30.0.41",), ports=(ServicePort("p80", "TCP", 80),))
    recs = [("Service", svc), ("Node", Node("node-a", ("192.168.0.2",), (("topology.kubernetes.io/zone", node_zone),)))]
    if slices is None:
        slices = [EndpointSlice("ns1", "svc1-a", "svc1", "IPv4", tuple(endpoints), (EndpointPort("p80", "TCP", 80),))]
    recs += [("EndpointSlice", s) for s in slices]
    return state_from_records(recs)


def test_endpoints_sorted_as_strings_and_first_address_only():
    st = _state(Endpoint(("10.1.1.1", "10.9.9.9")), Endpoint(("10.1.1.11",)), Endpoint(("10.1.1.2",)))
    [(info, cat)] = service_ports(st, CFG, 4)
    assert info.name == "ns1/svc1:p80" and info.protocol == "tcp"
    assert [e.endpoint for e in cat.all] == ["10.1.1.11:80", "10.1.1.1:80", "10.1.1.2:80"]


def test_port_matched_by_name_and_protocol_not_target_port():
    svc = Service("ns1", "svc1", cluster_ips=("172.30.0.41",),
                  ports=(ServicePort("a", "TCP", 80, target_port=9999), ServicePort("a", "UDP", 80)))
    sl = EndpointSlice("ns1", "s", "svc1", "IPv4", (Endpoint(("10.0.0.1",)),),
                       (EndpointPort("a", "UDP", 5353), EndpointPort("a", "TCP", 8080)))
    ports = service_ports(_state(service=svc, slices=[sl]), CFG, 4)
    assert [(i.protocol, [e.endpoint for e in c.all]) for i, c in ports] == [
        ("tcp", ["10.0.0.1:8080"]), ("udp", ["10.0.0.1:5353"])]


def test_slices_merged_and_family_filtered():
    svc = Service("ns1", "svc1", cluster_ips=("172.30.0.41", "fd00::41"), ports=(ServicePort("", "TCP", 80),))
    port = (EndpointPort("", "TCP", 80),)
    slices = [EndpointSlice("ns1", "a", "svc1", "IPv4", (Endpoint(("10.0.0.1",)),), port),
              EndpointSlice("ns1", "b", "svc1", "IPv4", (Endpoint(("10.0.0.2",)),), port),
              EndpointSlice("ns1", "c", "svc1", "IPv6", (Endpoint(("fd00::1",)),), port)]
    st = _state(service=svc, slices=slices)
    [(i4, c4)] = service_ports(st, CFG, 4)
    [(i6, c6)] = service_ports(st, CFG, 6)
    assert i4.name == "ns1/svc1" and i4.cluster_ip == "172.30.0.41" and i6.cluster_ip == "fd00::41"
    assert [e.endpoint for e in c4.all] == ["10.0.0.1:80", "10.0.0.2:80"]
    assert [e.endpoint for e in c6.all] == ["[fd00::1]:80"]


def test_conditions_and_has_endpoints():
    st = _state(Endpoint(("10.0.0.1",), ready=False, serving=False, terminating=True))
    [(_, cat)] = service_ports(st, CFG, 4)
    assert not cat.has_endpoints and cat.cluster == ()
    st = _state(Endpoint(("10.0.0.1",), ready=False, serving=True, terminating=True),
                Endpoint(("10.0.0.2",), ready=False, serving=False, terminating=False))
    [(_, cat)] = service_ports(st, CFG, 4)
    assert cat.has_endpoints and [e.ip for e in cat.cluster] == ["10.0.0.1"]


def test_local_policy_lists():
    svc = Service("ns1", "svc1", "NodePort", ("172.30.0.41",), ports=(ServicePort("p80", "TCP", 80, 30001),),
                  external_local=True)
    st = _state(Endpoint(("10.0.0.1",), node_name="node-a", ready=False, serving=True, terminating=True),
                Endpoint(("10.0.0.2",), node_name="node-b"), service=svc)
    [(info, cat)] = service_ports(st, CFG, 4)
    assert info.external_local and info.uses_local_endpoints and info.uses_cluster_endpoints
    assert [e.ip for e in cat.cluster] == ["10.0.0.2"]
    assert [e.ip for e in cat.local] == ["10.0.0.1"]          # local serving-terminating fallback
    assert [e.ip for e in cat.reachable] == ["10.0.0.1", "10.0.0.2"]
    # without a node name nothing is local
    [(_, cat)] = service_ports(st, Config.from_options(command="rules"), 4)
    assert cat.local == ()


def test_both_policies_local_still_use_cluster_endpoints_when_externally_accessible():
    """kube-proxy's UsesClusterEndpoints: the external chain sends pods' and the node's own traffic
    to the Cluster chain even with both policies Local, so that chain must exist (without it the
    whole iptables restore is refused)."""
    from clusterdns.proxy import iptables, iptsave
    svc = Service("ns1", "svc1", "NodePort", ("172.30.0.41",), ports=(ServicePort("p80", "TCP", 80, 30001),),
                  external_local=True, internal_local=True)
    st = _state(Endpoint(("10.0.0.1",), node_name="node-a"), Endpoint(("10.0.0.2",), node_name="node-b"), service=svc)
    [(info, cat)] = service_ports(st, CFG, 4)
    assert info.uses_cluster_endpoints and info.uses_local_endpoints
    assert [e.ip for e in cat.cluster] == ["10.0.0.1", "10.0.0.2"] and [e.ip for e in cat.local] == ["10.0.0.1"]
    nat = iptsave.read(iptables.render(st, CFG, 4).text)["nat"]
    jumped = {iptsave.target(r.spec) for r in nat.rules}
    assert {c for c in jumped if c.startswith("KUBE-")} <= set(nat.chains)
    # without external access the Cluster endpoints are not used
    internal = Service("ns1", "svc1", cluster_ips=("172.30.0.41",), ports=(ServicePort("p80", "TCP", 80),),
                       internal_local=True)
    [(info, _)] = service_ports(_state(Endpoint(("10.0.0.1",), node_name="node-a"), service=internal), CFG, 4)
    assert not info.uses_cluster_endpoints


def test_external_local_needs_external_access():
    svc = Service("ns1", "svc1", cluster_ips=("172.30.0.41",), ports=(ServicePort("p80", "TCP", 80),),
                  external_local=True)
    [(info, _)] = service_ports(_state(Endpoint(("10.0.0.1",)), service=svc), CFG, 4)
    assert not info.external_local


def test_node_info():
    st = _state(Endpoint(("10.0.0.1",)))
    node = node_info(st, Config.from_options(command="rules", node_name="node-a"), 4)
    assert node.ips == ("192.168.0.2",) and node.zone == "zone-a" and node.local_cidr == ""
    node = node_info(st, Config.from_options(command="rules", node_name="node-a", node_ips=("10.1.0.5", "192.168.0.2"),
                                nodeport_addresses=("primary", "192.168.0.0/16"), cluster_cidrs=("fd00::/64",
                                                                                                   "10.0.0.0/8")), 4)
    assert node.nodeport_ips == ("10.1.0.5", "192.168.0.2") and not node.nodeport_all
    assert node.local_cidr == "10.0.0.0/8"


def test_demo_cluster():
    records, _ = load_files([DEMO_MANIFEST])
    st = state_from_records(records)
    cfg = Config.from_options(command="rules", node_name="node-a")
    v4 = {i.name: (i, c) for i, c in service_ports(st, cfg, 4)}
    v6 = {i.name: (i, c) for i, c in service_ports(st, cfg, 6)}
    assert "testapp/testapp-headless:http" not in v4 and "testapp/external-db:pg" not in v4
    assert len(v4["testapp/testapp-svc"][1].cluster) == 74
    assert set(v6) == {"testapp/multiport:http", "testapp/multiport:https", "testapp/multiport:dns"}
    lb, cat = v4["testapp/testapp-lb:http"]
    assert lb.external_local and lb.affinity_timeout == 10800 and lb.lb_source_ranges == ("198.51.100.0/24",)
    assert [e.ip for e in cat.local] == ["10.161.34.10"]     # node-a's ready endpoint


def test_address_in_two_slices_counts_once_ready_copy_wins():
    port = (EndpointPort("p80", "TCP", 80),)
    slices = [EndpointSlice("ns1", "a", "svc1", "IPv4", (Endpoint(("10.0.0.1",), ready=False, serving=False),
                                                         Endpoint(("10.0.0.2",))), port),
              EndpointSlice("ns1", "b", "svc1", "IPv4", (Endpoint(("10.0.0.1",), node_name="node-a"),), port)]
    [(_, cat)] = service_ports(_state(slices=slices), CFG, 4)
    assert [(e.endpoint, e.ready, e.local) for e in cat.all] == [("10.0.0.1:80", True, True),
                                                                 ("10.0.0.2:80", True, False)]


def test_parse_endpoint_reads_what_format_endpoint_writes():
    from clusterdns.proxy.servicemap import format_endpoint, parse_endpoint
    for ip, port in (("10.0.0.1", 8080), ("fd00::1", 53), ("0.0.0.0", 0)):
        assert parse_endpoint(format_endpoint(ip, port)) == (ip, port)
    assert parse_endpoint("[FD00:0::1]:80") == ("fd00::1", 80)      # canonical, as records hold it
    assert parse_endpoint("010.0.0.1:80") is None                     # not an address
    for bad in ("10.0.0.1", "10.0.0.1:", "fd00::1:80", "[fd00::1]", "host:80", ""):
        assert parse_endpoint(bad) is None, bad
