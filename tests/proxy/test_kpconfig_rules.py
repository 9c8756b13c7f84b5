"""`clusterdns rules --proxy-config FILE` prints byte for byte what the equivalent flags print.

Every real configuration under the reference's real/ (and the k3s and RKE2
kube-proxy command lines) against the clusterdns flags that say the same, on
the demo cluster's manifest; each pair also shows the field in the text, so
an equality of two outputs that both ignored it cannot pass.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REAL = Path("/work/shared/reference/kubeproxy-config/real")
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="reference configs not present")
MANIFEST = str(Path(__file__).resolve().parents[2] / "clusterdns" / "demo" / "cluster.yaml")
HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def clusterdns(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterdns", *argv], capture_output=True, text=True, timeout=120)


def rules(*argv: str) -> str:
    proc = clusterdns("rules", "--manifest", MANIFEST, *argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout
    return proc.stdout


def same(config: Path, flags: list[str], *, extra: tuple[str, ...] = ("--node-name", "node-a")) -> str:
    from_file = rules("--proxy-config", str(config), *extra)
    from_flags = rules(*flags, *extra)
    assert from_file == from_flags
    return from_file


def doc(tmp_path: Path, text: str, name: str) -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def kind_docs() -> list[str]:
    return [d for d in (REAL / "kind.yaml").read_text().split("\n---\n") if yaml.safe_load(d) is not None]


@needs_real
def test_kubeadm_configmap():
    text = same(REAL / "kubeadm-configmap.yaml", ["--proxy-mode", "iptables", "--cluster-cidr", "10.244.0.0/16"])
    assert "! -s 10.244.0.0/16 -j KUBE-MARK-MASQ" in text


@needs_real
def test_eks_and_upstream_defaulted_are_the_defaults():
    eks = same(REAL / "eks.yaml", ["--proxy-mode", "iptables", "--sync-period", "30", "--min-sync-period", "1"])
    assert same(REAL / "upstream-defaulted.yaml", ["--proxy-mode", "iptables"]) == eks
    assert "*nat" in eks and "0x4000" in eks


@needs_real
def test_kind_iptables_nftables_and_rootless_ipvs(tmp_path):
    ipt, nft, ipvs = (doc(tmp_path, d, f"kind{i}.yaml") for i, d in enumerate(kind_docs()))
    assert "*nat" in same(ipt, ["--proxy-mode", "iptables"])
    text = same(nft, ["--proxy-mode", "nftables", "--nodeport-addresses", "primary"])
    assert "table ip kube-proxy" in text or "table inet" in text
    assert "# ipvsadm-restore input" in same(ipvs, ["--proxy-mode", "ipvs", "--min-sync-period", "0"])


@needs_real
def test_kubespray_ipvs():
    text = same(REAL / "kubespray.yaml", ["--proxy-mode", "ipvs", "--cluster-cidr", "10.233.64.0/18",
                                          "--ipvs-scheduler", "rr", "--min-sync-period", "0"])
    assert " -s rr" in text and "10.233.64.0/18" in text


def _args(path: Path) -> list[str]:
    data = yaml.safe_load(path.read_text())
    return data["args"] if "args" in data else data["spec"]["containers"][0]["args"]


@needs_real
@pytest.mark.parametrize("name", ["k3s-args.yaml", "rke2-args.yaml"])
def test_k3s_and_rke2_command_lines(tmp_path, name):
    """kube-proxy's own flags, verbatim, equal their KubeProxyConfiguration as a file."""
    equivalent = yaml.safe_load((REAL / "k3s-args.yaml").read_text())["equivalentConfig"]
    f = doc(tmp_path, yaml.safe_dump(equivalent), "equivalent.yaml")
    argv = _args(REAL / name)
    assert "--hostname-override=node1" in argv and "--conntrack-max-per-core=0" in argv
    from_flags = rules(*argv)
    assert rules("--proxy-config", str(f)) == from_flags
    assert "! -s 10.42.0.0/16 -j KUBE-MARK-MASQ" in from_flags


def test_every_rule_field(tmp_path):
    f = doc(tmp_path, HEAD + "mode: iptables\nbindAddress: 192.168.49.2\nclusterCIDR: 10.161.0.0/16\n"
            "iptables: {masqueradeAll: true, masqueradeBit: 5, localhostNodePorts: false, syncPeriod: 10s}\n"
            "nodePortAddresses: [192.168.49.0/24]\n", "all.yaml")
    text = same(f, ["--proxy-mode", "iptables", "--node-ip", "192.168.49.2", "--cluster-cidr", "10.161.0.0/16",
                    "--masquerade-all", "--masquerade-bit", "5", "--no-localhost-nodeports",
                    "--nodeport-addresses", "192.168.49.0/24", "--sync-period", "10"])
    assert "0x20" in text and "0x4000" not in text
    assert "-d 192.168.49.2/32" in text or "192.168.49.2" in text


def test_nftables_reads_its_own_section(tmp_path):
    f = doc(tmp_path, HEAD + "mode: nftables\niptables: {masqueradeAll: false, masqueradeBit: 3}\n"
            "nftables: {masqueradeAll: true, masqueradeBit: 7}\nclusterCIDR: 10.161.0.0/16\n", "nft.yaml")
    text = same(f, ["--proxy-mode", "nftables", "--masquerade-all", "--masquerade-bit", "7",
                    "--cluster-cidr", "10.161.0.0/16", "--nodeport-addresses", "primary"])
    assert "0x80" in text and "0x8 " not in text


def test_ipvs_scheduler_and_the_iptables_masquerade_bit(tmp_path):
    f = doc(tmp_path, HEAD + "mode: ipvs\nipvs: {scheduler: lc, minSyncPeriod: 0s}\n"
            "iptables: {masqueradeBit: 9, masqueradeAll: true}\nnftables: {masqueradeBit: 2}\n", "ipvs.yaml")
    text = same(f, ["--proxy-mode", "ipvs", "--ipvs-scheduler", "lc", "--masquerade-bit", "9", "--masquerade-all",
                    "--min-sync-period", "0"])
    assert " -s lc" in text and " -s rr" not in text and "0x200" in text


@pytest.mark.parametrize("body,needle", [
    ("iptables: {masqueradeBit: 40}",
     "KubeProxyConfiguration.KubeProxyIPTablesConfiguration.MasqueradeBit: Invalid value: 40"),
    ("mode: foo", 'KubeProxyConfiguration.Mode.ProxyMode: Invalid value: "foo"'),
    ("iptables: {syncPeriod: 30}", "KubeProxyConfiguration.iptables.syncPeriod"),
])
def test_a_bad_file_exits_2_with_one_line(tmp_path, body, needle):
    f = doc(tmp_path, HEAD + body + "\n", "bad.yaml")
    for command in ("rules", "proxy", "agent"):
        proc = clusterdns(command, "--manifest", MANIFEST, "--proxy-config", str(f), "--dry-run")
        assert proc.returncode == 2, (command, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("clusterdns: ") and needle in lines[0], proc.stderr
        assert proc.stdout == ""


@pytest.mark.parametrize("mode", ["iptables", "ipvs"])
def test_detect_local_by_interface(tmp_path, mode):
    """BridgeInterface and InterfaceNamePrefix: the input interface replaces the source CIDR
    (clusterCIDR is then not the detector), as kube-proxy's iptables and ipvs proxiers do."""
    f = doc(tmp_path, HEAD + f"mode: {mode}\nclusterCIDR: 10.99.0.0/16\ndetectLocalMode: BridgeInterface\n"
            "detectLocal: {bridgeInterface: cbr0, interfaceNamePrefix: veth}\n", "bridge.yaml")
    text = same(f, ["--proxy-mode", mode, "--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"])
    assert "! -i cbr0 -j KUBE-MARK-MASQ" in text and "10.99.0.0/16" not in text and "veth" not in text
    f = doc(tmp_path, HEAD + f"mode: {mode}\ndetectLocalMode: InterfaceNamePrefix\n"
            "detectLocal: {interfaceNamePrefix: veth}\n", "prefix.yaml")
    text = same(f, ["--proxy-mode", mode, "--detect-local-mode", "InterfaceNamePrefix",
                    "--pod-interface-name-prefix", "veth"])
    assert "! -i veth+ -j KUBE-MARK-MASQ" in text and "! -s 10.161.0.0/16" not in text
