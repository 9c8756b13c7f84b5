"""Which UDP flows are stale (pure), and the real conntrack CLI deleting them."""
import asyncio
import subprocess

from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.proxy.apply import Result, SubprocessRunner
from clusterdns.proxy.conntrack import ConntrackCleaner, Flow, deleted_count, stale_flows
from clusterdns.state import state_from_records
from tests.nslib import requires


def dns_service(node_port=0, extra_ips=(), proto="UDP"):
    return Service("kube-system", "kube-dns", "NodePort" if node_port else "ClusterIP", ("172.20.0.10",),
                   ports=(ServicePort("dns", proto, 53, node_port), ServicePort("dns-tcp", "TCP", 53)),
                   external_ips=tuple(extra_ips))


def dns_slice(*ips, ready=True, proto="UDP", name="kube-dns-1"):
    return EndpointSlice("kube-system", name, "kube-dns", "IPv4",
                         tuple(Endpoint((ip,), ready=ready) for ip in ips),
                         (EndpointPort("dns", proto, 53), EndpointPort("dns-tcp", "TCP", 53)))


def st(*records):
    kinds = {Service: "Service", EndpointSlice: "EndpointSlice"}
    return state_from_records([(kinds[type(r)], r) for r in records])


def test_removed_endpoint():
    old = st(dns_service(), dns_slice("10.1.0.1", "10.1.0.2"))
    new = st(dns_service(), dns_slice("10.1.0.2"))
    assert stale_flows(old, new) == [Flow(53, "172.20.0.10", "10.1.0.1")]


def test_removed_endpoint_with_nodeport_and_external_ip():
    svc = dns_service(node_port=30053, extra_ips=("192.0.2.7",))
    old = st(svc, dns_slice("10.1.0.1", "10.1.0.2"))
    new = st(svc, dns_slice("10.1.0.2"))
    assert set(stale_flows(old, new)) == {
        Flow(53, "172.20.0.10", "10.1.0.1"), Flow(53, "192.0.2.7", "10.1.0.1"), Flow(30053, None, "10.1.0.1")}


def test_endpoint_turning_unready_is_stale():
    old = st(dns_service(), dns_slice("10.1.0.1"), dns_slice("10.1.0.2", name="b"))
    new = st(dns_service(), dns_slice("10.1.0.1", ready=False), dns_slice("10.1.0.2", name="b"))
    assert stale_flows(old, new) == [Flow(53, "172.20.0.10", "10.1.0.1")]


def test_first_endpoints_clear_unnatted_flows():
    old = st(dns_service(node_port=30053))
    new = st(dns_service(node_port=30053), dns_slice("10.1.0.1"))
    assert set(stale_flows(old, new)) == {Flow(53, "172.20.0.10", None), Flow(30053, None, None)}


def test_new_service_with_endpoints_counts_as_first_endpoints():
    assert stale_flows(st(), st(dns_service(), dns_slice("10.1.0.1"))) == [Flow(53, "172.20.0.10", None)]


def test_deleted_service_clears_its_flows():
    old = st(dns_service(), dns_slice("10.1.0.1"))
    assert stale_flows(old, st()) == [Flow(53, "172.20.0.10", "10.1.0.1")]


def test_tcp_needs_nothing():
    old = st(dns_service(proto="TCP"), dns_slice("10.1.0.1", "10.1.0.2", proto="TCP"))
    new = st(dns_service(proto="TCP"), dns_slice("10.1.0.2", proto="TCP"))
    assert stale_flows(old, new) == []


def test_unchanged_and_added_endpoints_need_nothing():
    old = st(dns_service(), dns_slice("10.1.0.1"))
    new = st(dns_service(), dns_slice("10.1.0.1", "10.1.0.3"))
    assert stale_flows(old, new) == []
    assert stale_flows(old, old) == []


def test_keys_restrict_the_comparison():
    old = st(dns_service(), dns_slice("10.1.0.1", "10.1.0.2"))
    new = st(dns_service(), dns_slice("10.1.0.2"))
    assert stale_flows(old, new, keys=[("x", "y")]) == []
    assert stale_flows(old, new, keys=[("kube-system", "kube-dns")]) != []


def test_ipv6_family_ignores_ipv4():
    old = st(dns_service(), dns_slice("10.1.0.1"))
    assert stale_flows(old, st(), family=6) == []


def test_argv_and_exit_codes():
    assert Flow(53, "172.20.0.10", "10.1.0.1").argv() == [
        "conntrack", "-D", "-f", "ipv4", "-p", "udp", "--orig-dst", "172.20.0.10",
        "--orig-port-dst", "53", "--reply-src", "10.1.0.1"]
    assert Flow(30053).argv(6) == ["conntrack", "-D", "-f", "ipv6", "-p", "udp", "--orig-port-dst", "30053"]
    none = Result(("conntrack",), 1, "", "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n")
    assert deleted_count(none) == 0
    assert deleted_count(Result(("conntrack",), 0, "", "... 3 flow entries have been deleted.")) == 3
    assert deleted_count(Result(("conntrack",), 1, "", "conntrack: Operation not permitted")) is None


needs_root = requires("conntrack")


def _insert(ns, client_port, backend):
    subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-I", "-p", "udp",
                    "-s", "10.244.0.9", "-d", "172.20.0.10", "--sport", str(client_port), "--dport", "53",
                    "-r", backend, "-q", "10.244.0.9", "--reply-port-src", "53",
                    "--reply-port-dst", str(client_port), "-t", "60", "-u", "SEEN_REPLY"],
                   check=True, capture_output=True)


def _listing(ns):
    out = subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L", "-p", "udp"],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


@needs_root
def test_real_cli_deletes_only_the_stale_flows(netns):
    _insert(netns, 40001, "10.1.0.1")
    _insert(netns, 40002, "10.1.0.2")
    assert len(_listing(netns)) == 2
    old = st(dns_service(), dns_slice("10.1.0.1", "10.1.0.2"))
    new = st(dns_service(), dns_slice("10.1.0.2"))
    cleaner = ConntrackCleaner(SubprocessRunner(["ip", "netns", "exec", netns]))
    assert asyncio.run(cleaner.clear(stale_flows(old, new))) == 1
    left = _listing(netns)
    assert len(left) == 1 and "src=10.1.0.2" in left[0], left
    # Nothing left to delete: exit status 1 from the CLI, not a failure.
    assert asyncio.run(cleaner.clear(stale_flows(old, new))) == 0
    assert cleaner.failures == 0


# ---------------------------------------------------------------- reconcile (the flows in the kernel)

from clusterdns.proxy.conntrack import Entry, parse_entries, reconcile  # noqa: E402

LISTING = """\
udp      17 29 src=10.244.0.9 dst=172.20.0.10 sport=40001 dport=53 src=10.1.0.1 dst=10.244.0.9 sport=53 dport=40001 [ASSURED] mark=0 use=1
udp      17 25 src=10.244.0.9 dst=172.20.0.10 sport=40002 dport=53 [UNREPLIED] src=10.1.0.9 dst=10.244.0.9 sport=53 dport=40002 mark=0 use=1
udp      17 20 src=10.244.0.9 dst=172.20.0.10 sport=40003 dport=53 [UNREPLIED] src=172.20.0.10 dst=10.244.0.9 sport=53 dport=40003 mark=0 use=1
udp      17 20 src=192.0.2.50 dst=192.168.49.2 sport=5000 dport=30053 src=10.1.0.9 dst=192.168.49.2 sport=53 dport=5000 mark=0 use=1
udp      17 20 src=192.168.49.2 dst=198.51.100.1 sport=5001 dport=30053 src=198.51.100.1 dst=192.168.49.2 sport=30053 dport=5001 mark=0 use=1
udp      17 20 src=10.244.0.9 dst=172.20.9.9 sport=5002 dport=53 src=10.1.0.7 dst=10.244.0.9 sport=53 dport=5002 mark=0 use=1
udp      17 20 src=10.244.0.9 dst=8.8.8.8 sport=5003 dport=53 src=8.8.8.8 dst=10.244.0.9 sport=53 dport=5003 mark=0 use=1
"""


def test_parse_entries():
    got = parse_entries(LISTING + "garbage line\n")
    assert got[0] == Entry("172.20.0.10", 53, "10.1.0.1") and got[0].dnat
    assert got[2] == Entry("172.20.0.10", 53, "172.20.0.10") and not got[2].dnat
    assert len(got) == 7


def test_reconcile_deletes_what_the_rules_no_longer_send_there():
    state = st(dns_service(node_port=30053), dns_slice("10.1.0.1"))
    flows = reconcile(parse_entries(LISTING), state, service_cidrs=("172.20.0.0/16",))
    assert flows == [
        Flow(30053, None, "10.1.0.9"),           # NodePort flow DNATed to an endpoint gone
        Flow(53, "172.20.0.10", "10.1.0.9"),     # ClusterIP flow DNATed to an endpoint gone
        Flow(53, "172.20.0.10", "172.20.0.10"),  # made before the rules existed, endpoints now
        Flow(53, "172.20.9.9", "10.1.0.7"),      # inside --service-cidr, no Service holds it now
    ]
    # the live flow to 10.1.0.1, the outgoing flow to port 30053 elsewhere and 8.8.8.8 stay
    assert reconcile(parse_entries(LISTING), state) == flows[:3]


def test_reconcile_when_a_port_has_no_endpoints_left():
    state = st(dns_service())
    flows = reconcile(parse_entries(LISTING), state)
    # DNATed flows go (their endpoints are gone); the un-NATed one has nothing better to reach
    assert flows == [Flow(53, "172.20.0.10", "10.1.0.1"), Flow(53, "172.20.0.10", "10.1.0.9")]


def test_reconcile_cleaner_lists_one_family_once():
    listing = Result(("conntrack",), 0, LISTING, "conntrack v1.4.7 (conntrack-tools): 7 flow entries have been shown.")
    from clusterdns.proxy.apply import RecordingRunner
    runner = RecordingRunner(lambda argv, stdin: listing if "-L" in argv else
                             Result(argv, 0, "", "1 flow entries have been deleted."))
    cleaner = ConntrackCleaner(runner, 4)
    assert asyncio.run(cleaner.reconcile(st(dns_service(), dns_slice("10.1.0.1")))) == 2
    assert runner.commands()[0] == "conntrack -L -f ipv4 -p udp"
    assert runner.commands()[1:] == [
        "conntrack -D -f ipv4 -p udp --orig-dst 172.20.0.10 --orig-port-dst 53 --reply-src 10.1.0.9",
        "conntrack -D -f ipv4 -p udp --orig-dst 172.20.0.10 --orig-port-dst 53 --reply-src 172.20.0.10"]
