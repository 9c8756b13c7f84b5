"""kube-proxy's configuration file: decoding, defaulting, the mode's section, validation.

The validation cases are kube-proxy's own (kubernetes/kubernetes
pkg/proxy/apis/config/validation/validation_test.go), written as the YAML a
user would put in the file, so they go through decoding and v1alpha1
defaulting first: where defaulting changes the input (a bare IP in
healthzBindAddress gets its port) the expectation says so.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from clusterdns import kpconfig
from clusterdns.config import ConntrackConfig, load
from clusterdns.errors import ConfigError
from clusterdns.kpconfig import KubeProxyConfigError, format_duration, loads, parse_duration

REAL = Path("/work/shared/reference/kubeproxy-config/real")
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="reference configs not present")
HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
S = 10**9


def kp(body: str = "") -> kpconfig.KubeProxyConfig:
    return loads(HEAD + body, "f.yaml")


def error_of(body: str) -> str:
    with pytest.raises(KubeProxyConfigError) as exc:
        kp(body)
    return str(exc.value)


def real_documents(name: str) -> list[str]:
    """The YAML documents of a reference file, each as its own text (comment-only ones dropped)."""
    text = (REAL / name).read_text()
    return [d for d in text.split("\n---\n") if yaml.safe_load(d) is not None]


# ------------------------------------------------------------------ Go durations

@pytest.mark.parametrize("text,ns", [
    ("0", 0), ("0s", 0), ("30s", 30 * S), ("1h0m0s", 3600 * S), ("24h0m0s", 86400 * S),
    ("250ms", 250_000_000), ("1.5s", 1_500_000_000), ("-5s", -5 * S), ("15m0s", 900 * S),
    ("1m30s", 90 * S), ("100us", 100_000), ("2h45m", (2 * 3600 + 45 * 60) * S),
])
def test_go_durations(text, ns):
    assert parse_duration(text) == ns


@pytest.mark.parametrize("text", ["", "30", "1x", "s", "1.2.3s", "-", "1h-5m"])
def test_go_duration_errors(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("ns,text", [
    (0, "0s"), (30 * S, "30s"), (3600 * S, "1h0m0s"), (86400 * S, "24h0m0s"), (-5 * S, "-5s"),
    (250_000_000, "250ms"), (1_500_000_000, "1.5s"), (90 * S, "1m30s"), (900 * S, "15m0s"), (1500, "1.5µs"),
])
def test_go_duration_strings(ns, text):
    assert format_duration(ns) == text


# ------------------------------------------------------------------ defaults

@needs_real
def test_empty_file_defaults_to_upstream_golden():
    """An empty KubeProxyConfiguration defaults to exactly what real/upstream-defaulted.yaml lists."""
    golden, strict = kpconfig.decode(yaml.safe_load((REAL / "upstream-defaulted.yaml").read_text()))
    assert strict == []
    tree, strict = kpconfig.decode(yaml.safe_load(HEAD))
    assert kpconfig.set_defaults(tree) == golden


def test_defaults_and_selection():
    k = kp()
    assert (k.mode, k.sync_period, k.min_sync_period, k.masquerade_bit, k.masquerade_all) == \
        ("iptables", 30 * S, 1 * S, 14, False)
    assert k.detect_local_mode == "ClusterCIDR" and k.nodeport_addresses == () and k.cluster_cidrs == ()
    t = k.tree
    assert t["healthzBindAddress"] == "0.0.0.0:10256" and t["metricsBindAddress"] == "127.0.0.1:10249"
    assert t["conntrack"]["maxPerCore"] == 32768 and t["conntrack"]["min"] == 131072
    assert t["conntrack"]["tcpEstablishedTimeout"] == 86400 * S and t["conntrack"]["tcpCloseWaitTimeout"] == 3600 * S
    assert t["oomScoreAdj"] == -999 and t["configSyncPeriod"] == 900 * S
    assert t["iptables"]["localhostNodePorts"] is True


def test_pointer_fields_keep_an_explicit_zero():
    t = kp("conntrack:\n  maxPerCore: 0\n  min: 0\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n"
           "iptables:\n  masqueradeBit: 0\n  localhostNodePorts: false\noomScoreAdj: 0\n").tree
    assert (t["conntrack"]["maxPerCore"], t["conntrack"]["min"]) == (0, 0)
    assert (t["conntrack"]["tcpEstablishedTimeout"], t["conntrack"]["tcpCloseWaitTimeout"]) == (0, 0)
    assert (t["iptables"]["masqueradeBit"], t["iptables"]["localhostNodePorts"], t["oomScoreAdj"]) == (0, False, 0)


def test_null_pointers_are_defaulted():
    t = kp("conntrack:\n  maxPerCore: null\n  tcpEstablishedTimeout: null\noomScoreAdj: null\n").tree
    assert (t["conntrack"]["maxPerCore"], t["conntrack"]["tcpEstablishedTimeout"], t["oomScoreAdj"]) == \
        (32768, 86400 * S, -999)


def test_zero_durations_are_defaulted_but_ipvs_min_sync_is_not():
    k = kp("mode: iptables\niptables:\n  syncPeriod: 0s\n  minSyncPeriod: 0s\n")
    assert (k.sync_period, k.min_sync_period) == (30 * S, 1 * S)
    k = kp("mode: ipvs\nipvs:\n  syncPeriod: 0s\n  minSyncPeriod: 0s\n")
    assert (k.sync_period, k.min_sync_period) == (30 * S, 0)


def test_the_mode_picks_its_section():
    body = ("iptables: {syncPeriod: 11s, minSyncPeriod: 2s, masqueradeAll: true, masqueradeBit: 3}\n"
            "nftables: {syncPeriod: 22s, minSyncPeriod: 3s, masqueradeAll: false, masqueradeBit: 5}\n"
            "ipvs: {syncPeriod: 33s, minSyncPeriod: 4s}\n")
    for mode, want in (("", (11, 2, True, 3)), ("iptables", (11, 2, True, 3)),
                       ("nftables", (22, 3, False, 5)), ("ipvs", (33, 4, True, 3))):
        k = kp(f"mode: '{mode}'\n" + body)
        assert (k.sync_period // S, k.min_sync_period // S, k.masquerade_all, k.masquerade_bit) == want, mode
    assert kp("mode: ''\n").mode == "iptables"


def test_nftables_without_nodeport_addresses_is_primary():
    assert kp("mode: nftables\n").nodeport_addresses == ("primary",)
    assert kp("mode: nftables\nnodePortAddresses: [10.0.0.0/8]\n").nodeport_addresses == ("10.0.0.0/8",)
    assert kp("mode: iptables\n").nodeport_addresses == ()


def test_healthz_and_metrics_addresses():
    t = kp("healthzBindAddress: 10.1.2.3\nmetricsBindAddress: 0.0.0.0\n").tree
    assert (t["healthzBindAddress"], t["metricsBindAddress"]) == ("10.1.2.3:10256", "0.0.0.0:10249")
    t = kp("bindAddress: '::'\n").tree
    assert (t["healthzBindAddress"], t["metricsBindAddress"]) == ("[::]:10256", "[::1]:10249")
    t = kp("healthzBindAddress: 'fd00::1'\n").tree
    assert t["healthzBindAddress"] == "[fd00::1]:10256"


# ------------------------------------------------------------------ decoding

def test_unknown_fields_warn_once_and_are_ignored(caplog):
    with caplog.at_level(logging.WARNING, "clusterdns.kpconfig"):
        k = kp("udpIdleTimeout: 250ms\nresourceContainer: ''\nconntrack:\n  max: 0\n")
    assert k.lenient == ('unknown field "udpIdleTimeout"', 'unknown field "resourceContainer"',
                         'unknown field "conntrack.max"')
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "using lenient decoding as strict decoding failed: strict decoding error: " in lines[0]
    assert 'unknown field "conntrack.max"' in lines[0] and 'unknown field "udpIdleTimeout"' in lines[0]


def test_mis_cased_field_is_unknown_not_matched():
    k = kp("iptables:\n  masqueradeALL: true\nMode: ipvs\n")
    assert k.masquerade_all is False and k.mode == "iptables"
    assert k.lenient == ('unknown field "iptables.masqueradeALL"', 'unknown field "Mode"')


def test_duplicate_field_warns_and_last_wins(caplog):
    with caplog.at_level(logging.WARNING, "clusterdns.kpconfig"):
        k = kp("mode: iptables\nmode: ipvs\niptables:\n  syncPeriod: 5s\n  syncPeriod: 7s\n")
    assert k.mode == "ipvs" and k.tree["iptables"]["syncPeriod"] == 7 * S
    assert k.lenient == ('duplicate field "mode"', 'duplicate field "iptables.syncPeriod"')
    assert len(caplog.records) == 1


@pytest.mark.parametrize("body,where", [
    ("iptables:\n  syncPeriod: 30\n", "KubeProxyConfiguration.iptables.syncPeriod"),
    ("mode: 5\n", "KubeProxyConfiguration.mode"),
    ("conntrack:\n  maxPerCore: many\n", "KubeProxyConfiguration.conntrack.maxPerCore"),
    ("iptables:\n  masqueradeAll: 'yes'\n", "KubeProxyConfiguration.iptables.masqueradeAll"),
    ("iptables: 5\n", "KubeProxyConfiguration.iptables"),
    ("nodePortAddresses: 10.0.0.0/8\n", "KubeProxyConfiguration.nodePortAddresses"),
    ("nodePortAddresses: [5]\n", "KubeProxyConfiguration.nodePortAddresses[0]"),
    ("featureGates: {Foo: 1}\n", "KubeProxyConfiguration.featureGates.Foo"),
    ("iptables:\n  masqueradeBit: 14.0\n", "KubeProxyConfiguration.iptables.masqueradeBit"),
    ("conntrack:\n  udpTimeout: 1x\n", "KubeProxyConfiguration.conntrack.udpTimeout"),
    ("oomScoreAdj: 9999999999\n", "KubeProxyConfiguration.oomScoreAdj"),
])
def test_type_errors_are_fatal_and_name_the_field(body, where):
    msg = error_of(body)
    assert msg.startswith("f.yaml: failed to decode: " + where + ":"), msg
    assert "\n" not in msg


def test_yaml_one_one_booleans_decode_as_bools():
    assert kp("iptables:\n  masqueradeAll: yes\n").masquerade_all is True


@pytest.mark.parametrize("text,needle", [
    ("apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n",
     'no kind "KubeProxyConfiguration" is registered for version "kubeproxy.config.k8s.io/v1beta1"'),
    ("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n", 'no kind "KubeletConfiguration"'),
    ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfig\n", 'no kind "KubeProxyConfig"'),
    ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nmode: ipvs\n", "Object 'Kind' is missing"),
    ("kind: KubeProxyConfiguration\n", "Object 'apiVersion' is missing"),
    ("", "Object 'Kind' is missing"),
    ("# only a comment\n", "Object 'Kind' is missing"),
    ("mode: [ipvs\n", "f.yaml:2: failed to decode"),
    ("- a\n- b\n", "expected a KubeProxyConfiguration object"),
])
def test_bad_documents_are_fatal(text, needle):
    with pytest.raises(KubeProxyConfigError) as exc:
        loads(text, "f.yaml")
    assert needle in str(exc.value)


def configmap(key: str, body: str) -> str:
    inner = "\n".join("    " + line for line in (HEAD + body).splitlines())
    return f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kube-proxy\ndata:\n  {key}: |\n{inner}\n"


def test_a_configmap_is_read_at_config_conf_or_eks_config():
    assert loads(configmap("config.conf", "mode: ipvs\n"), "cm.yaml").mode == "ipvs"
    assert loads(configmap("config", "mode: nftables\n"), "cm.yaml").mode == "nftables"
    with pytest.raises(KubeProxyConfigError, match="no data key config.conf or config .its keys: kubeconfig"):
        loads(configmap("kubeconfig", "mode: ipvs\n"), "cm.yaml")


def test_a_stream_picks_its_one_kube_proxy_document():
    other = "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: kube-proxy}\n"
    assert loads(other + "---\n" + HEAD + "mode: ipvs\n", "s.yaml").mode == "ipvs"
    with pytest.raises(KubeProxyConfigError, match="kube-proxy reads exactly one"):
        loads(HEAD + "---\n" + HEAD, "s.yaml")


# ------------------------------------------------------------------ validation (validation_test.go)

P = "KubeProxyConfiguration"
LINUX = f"{P}.KubeProxyLinuxConfiguration"
CT = f"{LINUX}.KubeProxyConntrackConfiguration"
CASES = [
    # TestValidateKubeProxyIPTablesConfiguration / TestValidateMasqueradeBit
    ("iptables: {masqueradeBit: -10}",
     f"{P}.KubeProxyIPTablesConfiguration.MasqueradeBit: Invalid value: -10: must be within the range [0, 31]"),
    ("iptables: {masqueradeBit: 32}",
     f"{P}.KubeProxyIPTablesConfiguration.MasqueradeBit: Invalid value: 32: must be within the range [0, 31]"),
    ("mode: nftables\nnftables: {masqueradeBit: 32}",
     f"{P}.KubeProxyNFTablesConfiguration.MasqueradeBit: Invalid value: 32: must be within the range [0, 31]"),
    # TestValidateKubeProxyIPVSConfiguration / TestValidateIPVSTimeout
    ("mode: ipvs\nipvs: {tcpTimeout: -1s, udpTimeout: -1s, tcpFinTimeout: -1s}",
     f"[{P}.KubeProxyIPVSConfiguration.TCPTimeout: Invalid value: -1s: must be greater than or equal to 0, "
     f"{P}.KubeProxyIPVSConfiguration.TCPFinTimeout: Invalid value: -1s: must be greater than or equal to 0, "
     f"{P}.KubeProxyIPVSConfiguration.UDPTimeout: Invalid value: -1s: must be greater than or equal to 0]"),
    # TestValidateKubeProxyLinuxConfiguration
    ("oomScoreAdj: 9000", f"{LINUX}.OOMScoreAdj: Invalid value: 9000: must be within the range [-1000, 1000]"),
    ("oomScoreAdj: -9000", f"{LINUX}.OOMScoreAdj: Invalid value: -9000: must be within the range [-1000, 1000]"),
    ("conntrack: {maxPerCore: -1}", f"{CT}.MaxPerCore: Invalid value: -1: must be greater than or equal to 0"),
    ("conntrack: {min: -1}", f"{CT}.Min: Invalid value: -1: must be greater than or equal to 0"),
    ("conntrack: {tcpEstablishedTimeout: -5s}",
     f"{CT}.TCPEstablishedTimeout: Invalid value: -5s: must be greater than or equal to 0"),
    ("conntrack: {tcpCloseWaitTimeout: -5s}",
     f"{CT}.TCPCloseWaitTimeout: Invalid value: -5s: must be greater than or equal to 0"),
    ("conntrack: {udpTimeout: -5s}", f"{CT}.UDPTimeout: Invalid value: -5s: must be greater than or equal to 0"),
    ("conntrack: {udpStreamTimeout: -5s}",
     f"{CT}.UDPStreamTimeout: Invalid value: -5s: must be greater than or equal to 0"),
    # TestValidateProxyMode
    ("mode: non-existing",
     f'{P}.Mode.ProxyMode: Invalid value: "non-existing": must be iptables, ipvs, nftables or blank '
     "(blank means the best-available proxy [currently iptables])"),
    ("mode: userspace", f'{P}.Mode.ProxyMode: Invalid value: "userspace": must be iptables, ipvs, nftables'),
    ("mode: kernelspace", f'{P}.Mode.ProxyMode: Invalid value: "kernelspace"'),
    # TestValidateClientConnectionConfiguration
    ("clientConnection: {burst: -5}", f"{P}.ClientConnection.Burst: Invalid value: -5: must be greater than or equal to 0"),
    # TestValidateHostPort (through healthzBindAddress; "10.10.10.10" gets port 10256 from defaulting)
    ("healthzBindAddress: 123.456.789.10:12345",
     f'{P}.HealthzBindAddress: Invalid value: "123.456.789.10": must be a valid IP'),
    ("healthzBindAddress: 10.10.10.10:foo", f'{P}.HealthzBindAddress: Invalid value: "foo": must be a valid port'),
    ("healthzBindAddress: 10.10.10.10:0", f'{P}.HealthzBindAddress: Invalid value: "0": must be a valid port'),
    ("healthzBindAddress: 10.10.10.10:65536",
     f'{P}.HealthzBindAddress: Invalid value: "65536": must be a valid port'),
    ("healthzBindAddress: foo", f'{P}.HealthzBindAddress: Invalid value: "foo": must be IP:port'),
    ("metricsBindAddress: localhost:10249",
     f'{P}.MetricsBindAddress: Invalid value: "localhost": must be a valid IP'),
    # TestValidateKubeProxyConfiguration
    ("configSyncPeriod: -1s", f"{P}.ConfigSyncPeriod: Invalid value: -1s: must be greater than 0"),
    ("iptables: {syncPeriod: -5s, minSyncPeriod: 2s}",
     f"[{P}.SyncPeriod: Invalid value: -5s: must be greater than 0, "
     f"{P}.SyncPeriod: Invalid value: 2s: must be greater than or equal to {P}.MinSyncPeriod]"),
    ("iptables: {minSyncPeriod: -2s}", f"{P}.MinSyncPeriod: Invalid value: -2s: must be greater than or equal to 0"),
    ("iptables: {syncPeriod: 1s, minSyncPeriod: 5s}",
     f"{P}.SyncPeriod: Invalid value: 5s: must be greater than or equal to {P}.MinSyncPeriod"),
    ("mode: nftables\nnftables: {syncPeriod: 1s, minSyncPeriod: 5s}",
     f"{P}.SyncPeriod: Invalid value: 5s: must be greater than or equal to {P}.MinSyncPeriod"),
    ("detectLocalMode: Guess",
     f'{P}.DetectLocalMode: Unsupported value: "Guess": supported values: "ClusterCIDR", "NodeCIDR", '
     '"BridgeInterface", "InterfaceNamePrefix", ""'),
    ("logging: {format: unsupported format}",
     f'{P}.logging.format: Invalid value: "unsupported format": Unsupported log format'),
    ("bindAddress: foo", f'{P}.BindAddress: Invalid value: "foo": not a valid textual representation of an IP address'),
    ("portRange: abc", f'{P}.PortRange: Invalid value: "abc": must be a valid port range (e.g. 300-2000)'),
    ("portRange: 2000-300", f'{P}.PortRange: Invalid value: "2000-300"'),
    # TestValidateDetectLocalConfiguration
    ("detectLocalMode: InterfaceNamePrefix",
     f'{P}.DetectLocalConfiguration.InterfacePrefix: Invalid value: "": must not be empty'),
    ("detectLocalMode: BridgeInterface\ndetectLocal: {interfaceNamePrefix: eth0}",
     f'{P}.DetectLocalConfiguration.InterfaceName: Invalid value: "": must not be empty'),
    # TestValidateDualStackCIDRStrings (clusterCIDR split on commas)
    ("clusterCIDR: 10.100.0.0/16,192.168.0.0/16,fde4:8dba:82e1::/48",
     f'{P}.DetectLocalConfiguration.ClusterCIDRs: Invalid value: []string{{"10.100.0.0/16", "192.168.0.0/16", '
     '"fde4:8dba:82e1::/48"}: must be a either a single CIDR or dual-stack pair of CIDRs '
     "(e.g. [10.100.0.0/16, fde4:8dba:82e1::/48]"),
    ("clusterCIDR: fd00:10:96::/112,fde4:8dba:82e1::/48",
     f'{P}.DetectLocalConfiguration.ClusterCIDRs: Invalid value: []string{{"fd00:10:96::/112", '
     '"fde4:8dba:82e1::/48"}: must be a either a single CIDR or dual-stack pair'),
    ("clusterCIDR: fd00:10:96::,192.168.0.0/16",
     f'{P}.DetectLocalConfiguration.ClusterCIDRs[0]: Invalid value: "fd00:10:96::": must be a valid CIDR block '
     "(e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)"),
    ("clusterCIDR: fde4:8dba:82e1::/48,172.16.200.0:24",
     f'{P}.DetectLocalConfiguration.ClusterCIDRs[1]: Invalid value: "172.16.200.0:24": must be a valid CIDR block'),
    # TestValidateKubeProxyNodePortAddress
    ("nodePortAddresses: [foo]", f'{P}.NodePortAddresses[0]: Invalid value: "foo": must be a valid CIDR'),
    ("nodePortAddresses: [10.0.0.0/0, 1.2.3]", f'{P}.NodePortAddresses[1]: Invalid value: "1.2.3": must be a valid CIDR'),
    ("nodePortAddresses: [127.0.0.1/32, '0', 1.2.3.0/24]",
     f'{P}.NodePortAddresses[1]: Invalid value: "0": must be a valid CIDR'),
    ("nodePortAddresses: [127.0.0.1/32, 10.20.30.40, 1.2.3.0/24]",
     f'{P}.NodePortAddresses[1]: Invalid value: "10.20.30.40": must be a valid CIDR'),
    ("nodePortAddresses: ['::0', '::1', '2001:db8::/32']",
     f'[{P}.NodePortAddresses[0]: Invalid value: "::0": must be a valid CIDR, '
     f'{P}.NodePortAddresses[1]: Invalid value: "::1": must be a valid CIDR]'),
    ("nodePortAddresses: ['::1/128', '2001:db8::/32', '2001:db8:xyz/64']",
     f'{P}.NodePortAddresses[2]: Invalid value: "2001:db8:xyz/64": must be a valid CIDR'),
    ("nodePortAddresses: [primary, 10.0.0.0/8]",
     f"{P}.NodePortAddresses[0]: Invalid value: \"primary\": can't use both 'primary' and CIDRs"),
    ("nodePortAddresses: [10.0.0.0/8, primary]",
     f"{P}.NodePortAddresses[1]: Invalid value: \"primary\": can't use both 'primary' and CIDRs"),
    ("nodePortAddresses: [all]", f'{P}.NodePortAddresses[0]: Invalid value: "all": must be a valid CIDR'),
    # TestValidateKubeProxyExcludeCIDRs (validated in ipvs mode only)
    ("mode: ipvs\nipvs: {excludeCIDRs: [foo]}",
     f'{P}.KubeProxyIPVSConfiguration.ExcludeCidrs[0]: Invalid value: "foo": must be a valid CIDR'),
    ("mode: ipvs\nipvs: {excludeCIDRs: [10.0.0.0/0, 1.2.3]}",
     f'{P}.KubeProxyIPVSConfiguration.ExcludeCidrs[1]: Invalid value: "1.2.3": must be a valid CIDR'),
    ("showHiddenMetricsForVersion: '1.20'",
     f"{P}.ShowHiddenMetricsForVersion: Invalid value: \"1.20\": --show-hidden-metrics-for-version must be "
     "omitted or have the value '1.34'"),
]


@pytest.mark.parametrize("body,want", CASES, ids=[c[0][:60] for c in CASES])
def test_validation_errors(body, want):
    msg = error_of(body + "\n")
    assert msg.startswith("f.yaml: failed validate: ")
    assert msg[len("f.yaml: failed validate: "):].startswith(want), msg
    assert "\n" not in msg


@pytest.mark.parametrize("body", [
    "mode: ipvs",
    "oomScoreAdj: 900\nconntrack: {tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}",
    "oomScoreAdj: -900",
    "clientConnection: {burst: 0}",
    "clientConnection: {burst: 5}",
    "healthzBindAddress: 0.0.0.0:10256", "healthzBindAddress: 127.0.0.1:10256", "healthzBindAddress: 10.10.10.10:10256",
    "healthzBindAddress: 10.10.10.10",     # a bare IP: defaulting appends :10256
    "metricsBindAddress: 127.0.0.1",
    "healthzBindAddress: 0.0.0.0:12345",
    "metricsBindAddress: '[::1]:10249'\nbindAddress: '::'",
    "clusterCIDR: 192.168.59.0/24,fd00:192:168::/64",
    "clusterCIDR: fd00:192:168:59::/64",
    "detectLocalMode: ClusterCIDR\nclusterCIDR: 10.0.0.0/8",
    "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: vethabcde}",
    "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: avz}",
    "nodePortAddresses: []", "nodePortAddresses: [127.0.0.0/8]", "nodePortAddresses: [0.0.0.0/0]",
    "nodePortAddresses: ['::/0']", "nodePortAddresses: [127.0.0.1/32, 1.2.3.0/24]",
    "nodePortAddresses: ['::1/128']", "nodePortAddresses: [10.20.0.0/16, 100.200.0.0/16]",
    "nodePortAddresses: ['2001:db8::/32']", "nodePortAddresses: [primary]",
    "mode: ipvs\nipvs: {excludeCIDRs: [127.0.0.1/32, 1.2.3.0/24, '::1/128', '2001:db8::/32']}",
    "mode: iptables\nipvs: {excludeCIDRs: [foo]}",       # not the running mode: not validated
    "mode: ipvs\nipvs: {tcpTimeout: 1s, tcpFinTimeout: 2s, udpTimeout: 3s}",
    "mode: iptables\nnftables: {masqueradeBit: 99}",     # likewise
    "portRange: 300-2000", "portRange: '300+100'", "portRange: '8080'",
    "showHiddenMetricsForVersion: '1.34'",
    "bindAddress: 010.001.002.003",                      # ParseIPSloppy takes leading zeros
    "logging: {format: json}",
])
def test_valid_configurations(body):
    kp(body + "\n")


def test_several_errors_are_one_line_in_kube_proxys_aggregate_form():
    msg = error_of("oomScoreAdj: 9000\nmode: bogus\n")
    assert msg == (f"f.yaml: failed validate: [{LINUX}.OOMScoreAdj: Invalid value: 9000: must be within the range "
                   f'[-1000, 1000], {P}.Mode.ProxyMode: Invalid value: "bogus": must be iptables, ipvs, nftables or '
                   "blank (blank means the best-available proxy [currently iptables])]")


def test_what_clusterdns_cannot_do_is_refused_with_the_field():
    assert "DetectLocalMode: Unsupported value: \"NodeCIDR\"" in error_of("detectLocalMode: NodeCIDR\n")
    assert 'DetectLocalMode: Unsupported value: "BridgeInterface" in mode nftables' in \
        error_of("mode: nftables\ndetectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\n")
    assert 'DetectLocalMode: Unsupported value: "InterfaceNamePrefix" in mode nftables' in \
        error_of("mode: nftables\ndetectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}\n")
    assert 'KubeProxyIPVSConfiguration.Scheduler: Unsupported value: "foo"' in \
        error_of("mode: ipvs\nipvs: {scheduler: foo}\n")


# ------------------------------------------------------------------ the real configurations

def opts_of(path: Path, *argv: str):
    return load(["rules", "--proxy-config", str(path), "--manifest", "clusterdns/demo/cluster.yaml", *argv], env={})


def write(tmp_path: Path, text: str, name: str = "kp.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


@needs_real
def test_kubeadm_configmap(tmp_path, monkeypatch):
    monkeypatch.setattr(kpconfig, "default_hostname", lambda: "host-1")
    cfg = opts_of(REAL / "kubeadm-configmap.yaml")
    px = cfg.proxy
    assert (px.proxy_mode, px.sync_period, px.min_sync_period, px.masquerade_bit, px.masquerade_all) == \
        ("iptables", 30.0, 1.0, 14, False)
    assert px.cluster_cidrs == ("10.244.0.0/16",) and px.nodeport_addresses == () and px.localhost_nodeports
    assert px.conntrack == ConntrackConfig(32768, 131072, 86400, 3600, False, 0, 0)
    assert px.oom_score_adj == -999 and px.node_ips == () and px.node_name == "host-1"
    assert (cfg.agent.proxy_health_listen, cfg.agent.proxy_metrics_listen) == ("0.0.0.0:10256", "127.0.0.1:10249")
    # the DaemonSet's --hostname-override=$(NODE_NAME) wins, lower-cased
    assert opts_of(REAL / "kubeadm-configmap.yaml", "--hostname-override", " Node-A ").proxy.node_name == "node-a"
    cfg = load(["rules", "--proxy-config", str(REAL / "kubeadm-configmap.yaml"), "--manifest",
                "clusterdns/demo/cluster.yaml"], env={"NODE_NAME": "node-b"})
    assert cfg.proxy.node_name == "node-b"


@needs_real
def test_eks_config(caplog):
    with caplog.at_level(logging.WARNING, "clusterdns.kpconfig"):
        cfg = opts_of(REAL / "eks.yaml")
    px = cfg.proxy
    assert (px.proxy_mode, px.min_sync_period, px.oom_score_adj) == ("iptables", 1.0, -998)
    assert px.conntrack == ConntrackConfig(32768, 131072, 86400, 3600, False, 0, 0)
    assert cfg.agent.proxy_metrics_listen == "0.0.0.0:10249" and cfg.agent.proxy_health_listen == "0.0.0.0:10256"
    lenient = [r.getMessage() for r in caplog.records if "lenient" in r.getMessage()]
    assert len(lenient) == 1
    for name in ("conntrack.max", "resourceContainer", "udpIdleTimeout"):
        assert f'unknown field "{name}"' in lenient[0]


@needs_real
def test_kind_variants(tmp_path):
    docs = real_documents("kind.yaml")
    assert len(docs) == 3
    got = []
    for i, doc in enumerate(docs):
        k = loads(doc, f"kind-{i}")
        assert k.lenient == ('unknown field "metadata"',)
        got.append(k)
    ipt, nft, rootless = got
    assert (ipt.mode, ipt.min_sync_period, ipt.tree["conntrack"]["maxPerCore"]) == ("iptables", S, 0)
    assert (nft.mode, nft.nodeport_addresses, nft.tree["conntrack"]["tcpBeLiberal"]) == ("nftables", ("primary",), True)
    assert (rootless.mode, rootless.min_sync_period) == ("ipvs", 0)
    assert rootless.tree["conntrack"]["tcpEstablishedTimeout"] == 0
    cfg = opts_of(write(tmp_path, docs[2]))
    assert cfg.proxy.conntrack == ConntrackConfig(0, 131072, 0, 0, False, 0, 0)


@needs_real
def test_kubespray():
    cfg = opts_of(REAL / "kubespray.yaml")
    px = cfg.proxy
    assert (px.proxy_mode, px.sync_period, px.min_sync_period, px.ipvs_scheduler) == ("ipvs", 30.0, 0.0, "rr")
    assert px.cluster_cidrs == ("10.233.64.0/18",) and px.node_name == "node1" and px.ipvs_exclude_cidrs == ()
    assert px.conntrack == ConntrackConfig(32768, 131072, 86400, 3600, False, 0, 0)


@needs_real
def test_upstream_defaulted_equals_an_empty_file(tmp_path):
    a = opts_of(REAL / "upstream-defaulted.yaml", "--node-name", "n")
    b = opts_of(write(tmp_path, HEAD), "--node-name", "n")
    assert replace(a.proxy, proxy_config="") == replace(b.proxy, proxy_config="") and a.agent == b.agent


def test_flags_beside_the_file_are_ignored_except_hostname_and_logging(tmp_path, caplog):
    f = write(tmp_path, HEAD + "mode: nftables\n")
    with caplog.at_level(logging.WARNING, "clusterdns.kpconfig"):
        cfg = opts_of(f, "--proxy-mode", "ipvs", "--masquerade-all", "--cluster-cidr", "10.0.0.0/8",
                      "--healthz-bind-address", "1.2.3.4", "--conntrack-max-per-core", "7",
                      "--node-name", "Node-A", "--log-level", "debug")
    px = cfg.proxy
    assert (px.proxy_mode, px.masquerade_all, px.cluster_cidrs) == ("nftables", False, ())
    assert cfg.agent.proxy_health_listen == "0.0.0.0:10256" and px.conntrack.max_per_core == 32768
    assert px.node_name == "node-a" and cfg.agent.log_level == "debug"
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == 1
    for flag in ("--proxy-mode", "--masquerade-all", "--cluster-cidr", "--healthz-bind-address", "--conntrack-*"):
        assert flag in ignored[0]


def test_bind_address_is_the_node_ip(tmp_path):
    assert opts_of(write(tmp_path, HEAD + "bindAddress: 10.9.8.7\n")).proxy.node_ips == ("10.9.8.7",)
    assert opts_of(write(tmp_path, HEAD + "bindAddress: '::'\n")).proxy.node_ips == ()


def test_a_bad_file_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"KubeProxyConfiguration\.KubeProxyIPTablesConfiguration\.MasqueradeBit"):
        opts_of(write(tmp_path, HEAD + "iptables: {masqueradeBit: 40}\n"))
    with pytest.raises(ConfigError, match="No such file"):
        opts_of(tmp_path / "missing.yaml")


# ------------------------------------------------------------------ kube-proxy's flags without a file

def test_kube_proxy_flags_become_options():
    cfg = load(["proxy", "--manifest", "clusterdns/demo/cluster.yaml", "--proxy-mode", "ipvs",
                "--ipvs-sync-period", "10s", "--ipvs-min-sync-period", "0s", "--iptables-sync-period", "99s",
                "--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0s",
                "--conntrack-tcp-be-liberal", "--healthz-bind-address", "127.0.0.1",
                "--metrics-bind-address", "0.0.0.0", "--cluster-cidr", "10.42.0.0/16,fd00:42::/56",
                "--ipvs-scheduler", "lc", "--ipvs-strict-arp=true", "--hostname-override", "node1",
                "--oom-score-adj", "-500"], env={})
    px = cfg.proxy
    assert (px.sync_period, px.min_sync_period, px.ipvs_scheduler, px.ipvs_strict_arp) == (10.0, 0.0, "lc", True)
    assert px.conntrack == ConntrackConfig(0, 131072, 0, 3600, True, 0, 0)
    assert (cfg.agent.proxy_health_listen, cfg.agent.proxy_metrics_listen) == ("127.0.0.1:10256", "0.0.0.0:10249")
    assert px.cluster_cidrs == ("10.42.0.0/16", "fd00:42::/56") and px.node_name == "node1"
    assert px.oom_score_adj == -500
    # lower-cased as kube-proxy does, and winning over NODE_NAME as a flag does
    cfg = load(["proxy", "--manifest", "clusterdns/demo/cluster.yaml", "--hostname-override", " Node-B "],
               env={"NODE_NAME": "node-c"})
    assert cfg.proxy.node_name == "node-b"
    # the iptables pair is read outside ipvs mode (nftables too)
    cfg = load(["proxy", "--manifest", "clusterdns/demo/cluster.yaml", "--proxy-mode", "nftables",
                "--iptables-sync-period", "20s", "--iptables-min-sync-period", "2s"], env={})
    assert (cfg.proxy.sync_period, cfg.proxy.min_sync_period) == (20.0, 2.0)
    # no conntrack flag: clusterdns leaves conntrack alone
    assert load(["proxy", "--manifest", "clusterdns/demo/cluster.yaml"], env={}).proxy.conntrack is None


@pytest.mark.parametrize("argv,needle", [
    (["--ipvs-scheduler", "fifo"], 'Unsupported value: "fifo"'),
    (["--detect-local-mode", "Guess"], 'Unsupported value: "Guess"'),
    (["--detect-local-mode", "BridgeInterface"], "needs --pod-bridge-interface"),
    (["--detect-local-mode", "NodeCIDR"], "--detect-local-mode NodeCIDR: not supported"),
    (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth", "--proxy-mode", "nftables"],
     "detect-local-mode InterfaceNamePrefix in mode nftables: not supported"),
    (["--conntrack-min", "-1"], "--conntrack-min: must be greater than or equal to 0"),
    (["--healthz-bind-address", "nowhere"], "must be IP:port"),
    (["--oom-score-adj", "5000"], "--oom-score-adj 5000"),
    (["--hostname-override", "  "], "empty hostname-override is invalid"),
    (["--ipvs-exclude-cidrs", "10.0.0.0/8,bad"], '"bad": must be a valid CIDR'),
])
def test_bad_kube_proxy_flags(argv, needle):
    with pytest.raises(ConfigError) as exc:
        load(["proxy", "--manifest", "clusterdns/demo/cluster.yaml", *argv], env={})
    assert needle in str(exc.value)


def test_fields_not_applied_are_named_once(caplog):
    with caplog.at_level(logging.WARNING, "clusterdns.kpconfig"):
        k = kp("featureGates: {Foo: true}\nenableProfiling: true\nlogging: {format: json}\n"
               "clientConnection: {qps: 50}\n")
    assert kpconfig.not_applied(k) == ["clientConnection.qps", "enableProfiling", "featureGates (Foo=true)",
                                       "logging.format json (clusterdns logs text lines)"]
    assert kpconfig.not_applied(kp()) == []
