"""The host settings kube-proxy writes at start (conntrack sysctls, strictARP, oom_score_adj).

The rules of server_linux.go (FIELDS.md section 6) against a directory tree
standing in for /proc/sys and /sys, then for real: `clusterdns proxy
--proxy-config` in a network namespace, where the conntrack timeouts are
per-namespace (set to odd values first) and nf_conntrack_max is read-only,
with its healthz and metrics servers on the configured addresses, and
`--cleanup` after it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterdns.config import ConntrackConfig, load
from clusterdns.proxy.sysctl import Host, SysctlError, conntrack_max, host_setup, setup_conntrack
from tests.nslib import Namespaces, requires, run, sh

NF = "net/netfilter/"
HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
MANIFEST = str(Path(__file__).resolve().parents[2] / "clusterdns" / "demo" / "cluster.yaml")


def fake_host(tmp_path: Path, *, cpus: int = 4, sysfs: str = "rw", hashsize: int = 16384, **values: int) -> Host:
    proc = tmp_path / "proc_sys"
    (proc / "net/netfilter").mkdir(parents=True)
    (proc / "net/ipv4/conf/all").mkdir(parents=True)
    base = {"nf_conntrack_max": 65536, "nf_conntrack_tcp_timeout_established": 432000,
            "nf_conntrack_tcp_timeout_close_wait": 60, "nf_conntrack_tcp_be_liberal": 0,
            "nf_conntrack_udp_timeout": 30, "nf_conntrack_udp_timeout_stream": 120}
    base.update(values)
    for name, v in base.items():
        (proc / NF / name).write_text(f"{v}\n")
    for name in ("arp_ignore", "arp_announce"):
        (proc / "net/ipv4/conf/all" / name).write_text("0\n")
    (tmp_path / "hashsize").write_text(f"{hashsize}\n")
    (tmp_path / "mounts").write_text(f"proc /proc proc rw 0 0\nsysfs /sys sysfs {sysfs},nosuid 0 0\n")
    (tmp_path / "oom").write_text("0\n")
    return Host(proc_sys=str(proc), hashsize=str(tmp_path / "hashsize"), mounts=str(tmp_path / "mounts"),
                oom_score_adj=str(tmp_path / "oom"), cpus=lambda: cpus)


def read(host: Host, name: str) -> int:
    return int(Path(host.path(NF + name)).read_text())


@pytest.mark.parametrize("per_core,minimum,cpus,want", [
    (32768, 131072, 4, 131072), (32768, 131072, 16, 524288), (32768, 131072, 96, 3145728),
    (0, 131072, 16, 0), (10, 0, 3, 30), (1, 5, 2, 5),
])
def test_conntrack_max(per_core, minimum, cpus, want):
    assert conntrack_max(ConntrackConfig(max_per_core=per_core, min=minimum), cpus) == want


def test_defaults_write_kube_proxys_values(tmp_path):
    host = fake_host(tmp_path, cpus=16)
    changed = setup_conntrack(ConntrackConfig(), host)
    assert read(host, "nf_conntrack_max") == 524288
    assert int(Path(host.hashsize).read_text()) == 131072
    assert read(host, "nf_conntrack_tcp_timeout_established") == 86400
    assert read(host, "nf_conntrack_tcp_timeout_close_wait") == 3600
    # 0 / false leave these alone
    assert read(host, "nf_conntrack_tcp_be_liberal") == 0 and read(host, "nf_conntrack_udp_timeout") == 30
    assert changed == [NF + "nf_conntrack_max=524288", "hashsize=131072",
                       NF + "nf_conntrack_tcp_timeout_established=86400", NF + "nf_conntrack_tcp_timeout_close_wait=3600"]


def test_everything_set_and_a_lower_value_written_too(tmp_path):
    host = fake_host(tmp_path, cpus=2, nf_conntrack_max=1_000_000)
    setup_conntrack(ConntrackConfig(max_per_core=1000, min=10, tcp_established_timeout=7200,
                                    tcp_close_wait_timeout=1800, tcp_be_liberal=True, udp_timeout=45,
                                    udp_stream_timeout=180), host)
    # 1.29-1.35 write whenever different, lowering a host value too
    assert read(host, "nf_conntrack_max") == 2000
    assert int(Path(host.hashsize).read_text()) == 16384      # already >= 2000/4
    assert [read(host, n) for n in ("nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait",
                                    "nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout",
                                    "nf_conntrack_udp_timeout_stream")] == [7200, 1800, 1, 45, 180]


def test_max_per_core_zero_leaves_max_min_and_hashsize(tmp_path):
    host = fake_host(tmp_path, cpus=64)
    assert setup_conntrack(ConntrackConfig(max_per_core=0, min=999999, tcp_established_timeout=0,
                                           tcp_close_wait_timeout=0), host) == []
    assert read(host, "nf_conntrack_max") == 65536 and int(Path(host.hashsize).read_text()) == 16384
    assert read(host, "nf_conntrack_tcp_timeout_established") == 432000


def test_read_only_sys_skips_the_hashsize_with_a_warning(tmp_path, caplog):
    host = fake_host(tmp_path, cpus=16, sysfs="ro")
    setup_conntrack(ConntrackConfig(), host)
    assert read(host, "nf_conntrack_max") == 524288 and int(Path(host.hashsize).read_text()) == 16384
    assert any("/sys is read-only" in r.getMessage() for r in caplog.records)


def test_no_sysfs_is_fatal(tmp_path):
    host = fake_host(tmp_path, cpus=16)
    Path(host.mounts).write_text("proc /proc proc rw 0 0\n")
    with pytest.raises(SysctlError, match="no sysfs mounted"):
        setup_conntrack(ConntrackConfig(), host)


def test_read_only_proc_sys(tmp_path):
    """An equal value is not written (fine under a read-only /proc/sys); a different one is fatal."""
    host = fake_host(tmp_path, cpus=4, nf_conntrack_max=131072, nf_conntrack_tcp_timeout_established=86400,
                     nf_conntrack_tcp_timeout_close_wait=3600, hashsize=32768)
    for f in Path(host.proc_sys).rglob("*"):
        if f.is_file():
            f.chmod(0o444)
    if os.geteuid() == 0:
        # root ignores file modes: stand a directory in for the read-only sysctl
        bad = Path(host.path(NF + "nf_conntrack_udp_timeout"))
        bad.unlink()
        bad.mkdir()
    assert setup_conntrack(ConntrackConfig(), host) == []
    with pytest.raises(SysctlError, match="cannot set net/netfilter/nf_conntrack_udp_timeout to 5"):
        setup_conntrack(ConntrackConfig(udp_timeout=5), host)


def test_host_setup_strict_arp_and_oom(tmp_path):
    host = fake_host(tmp_path)
    cfg = load(["proxy", "--manifest", MANIFEST, "--proxy-mode", "ipvs", "--ipvs-strict-arp", "--oom-score-adj",
                "-999", "--conntrack-max-per-core", "0"], env={})
    changed = host_setup(cfg, host)
    assert "net/ipv4/conf/all/arp_ignore=1" in changed and "net/ipv4/conf/all/arp_announce=2" in changed
    assert Path(host.oom_score_adj).read_text().strip() == "-999"
    # kube-proxy's defaults for the flags not given beside --conntrack-max-per-core
    assert read(host, "nf_conntrack_tcp_timeout_established") == 86400
    # strictARP is an ipvs setting
    cfg = load(["proxy", "--manifest", MANIFEST, "--proxy-mode", "iptables", "--ipvs-strict-arp"], env={})
    host2 = fake_host(tmp_path / "b")
    assert host_setup(cfg, host2) == []


def test_nothing_configured_touches_nothing(tmp_path):
    host = fake_host(tmp_path)
    assert host_setup(load(["proxy", "--manifest", MANIFEST], env={}), host) == []


# ------------------------------------------------------------------ in a network namespace

def ns_sysctl(ns: str, name: str) -> int:
    return int(sh("cat", f"/proc/sys/net/netfilter/{name}", ns=ns).strip())


def http_get(ns: str, url: str) -> tuple[int, str]:
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=3); print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n")
    res = run(sys.executable, "-c", code, url, ns=ns)
    if res.returncode != 0:
        return 0, res.stderr
    status, _, body = res.stdout.partition("\n")
    return int(status), body


@requires("iptables-save")
def test_proxy_in_a_netns_writes_conntrack_serves_healthz_and_cleans_up(tmp_path):
    conf = tmp_path / "kube-proxy.conf"
    conf.write_text(HEAD + "mode: iptables\nhealthzBindAddress: 127.0.0.1:20256\n"
                    "metricsBindAddress: 127.0.0.1:20249\n"
                    "conntrack:\n  maxPerCore: 0\n  tcpEstablishedTimeout: 2h\n  tcpCloseWaitTimeout: 30m\n"
                    "  tcpBeLiberal: true\n  udpTimeout: 45s\n  udpStreamTimeout: 3m0.9s\n")
    with Namespaces("kpcfg") as nss:
        ns = nss.add("node")
        for name, odd in (("nf_conntrack_tcp_timeout_established", 12345), ("nf_conntrack_tcp_timeout_close_wait", 77),
                          ("nf_conntrack_tcp_be_liberal", 0), ("nf_conntrack_udp_timeout", 31),
                          ("nf_conntrack_udp_timeout_stream", 121)):
            sh("sh", "-c", f"echo {odd} > /proc/sys/net/netfilter/{name}", ns=ns)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "clusterdns", "proxy",
                                 "--proxy-config", str(conf), "--manifest", MANIFEST, "--node-name", "node-a",
                                 "--apply", "--health-listen", "none"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            status = 0
            while time.monotonic() < deadline and proc.poll() is None:
                status, body = http_get(ns, "http://127.0.0.1:20256/healthz")
                if status == 200:
                    break
                time.sleep(0.3)
            assert status == 200, (proc.poll(), body)
            assert [ns_sysctl(ns, n) for n in ("nf_conntrack_tcp_timeout_established",
                                               "nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_tcp_be_liberal",
                                               "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream")] == \
                [7200, 1800, 1, 45, 180]
            assert http_get(ns, "http://127.0.0.1:20256/livez")[0] == 200
            assert http_get(ns, "http://127.0.0.1:20256/metrics")[0] == 404     # healthz serves only those two
            status, body = http_get(ns, "http://127.0.0.1:20249/metrics")
            assert status == 200 and "kubeproxy_sync_proxy_rules" in body
            status, body = http_get(ns, "http://127.0.0.1:20249/proxyMode")
            assert (status, body.strip()) == (200, "iptables")
            assert "KUBE-SERVICES" in sh("iptables-save", "-t", "nat", ns=ns)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
        res = run(sys.executable, "-m", "clusterdns", "proxy", "--proxy-config", str(conf), "--cleanup", ns=ns)
        assert res.returncode == 0, res.stderr
        assert "KUBE-SERVICES" not in sh("iptables-save", "-t", "nat", ns=ns)


@requires("iptables-save")
def test_read_only_nf_conntrack_max_in_a_netns_is_fatal_unless_left_alone(tmp_path):
    """kind's crash loop: outside the initial netns nf_conntrack_max is read-only."""
    with Namespaces("kpro") as nss:
        ns = nss.add("node")
        current = ns_sysctl(ns, "nf_conntrack_max")
        conf = tmp_path / "c.yaml"
        conf.write_text(HEAD + f"conntrack:\n  maxPerCore: 1\n  min: {current + 1}\n")
        res = run(sys.executable, "-m", "clusterdns", "proxy", "--proxy-config", str(conf), "--manifest", MANIFEST,
                  "--apply", "--health-listen", "none", ns=ns, timeout=60)
        assert res.returncode == 1
        assert "nf_conntrack_max" in res.stderr and "maxPerCore: 0" in res.stderr
        assert "KUBE-SERVICES" not in sh("iptables-save", "-t", "nat", ns=ns)   # nothing applied
        # the value it already has is not written, so the same file with min = current starts
        conf.write_text(HEAD + f"conntrack:\n  maxPerCore: 1\n  min: {current}\n  tcpEstablishedTimeout: 0s\n"
                        "  tcpCloseWaitTimeout: 0s\nhealthzBindAddress: 127.0.0.1:20257\n"
                        "metricsBindAddress: 127.0.0.1:20250\n")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "clusterdns", "proxy",
                                 "--proxy-config", str(conf), "--manifest", MANIFEST, "--apply",
                                 "--health-listen", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline, status = time.monotonic() + 30, 0
            while time.monotonic() < deadline and proc.poll() is None and status != 200:
                status, _ = http_get(ns, "http://127.0.0.1:20257/healthz")
                time.sleep(0.3)
            assert status == 200, proc.poll()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)


def test_ipvs_exclude_cidrs_are_never_deleted():
    """ipvs.excludeCIDRs: a virtual server there that the rules no longer want is left in place."""
    from clusterdns.proxy.apply import ipvs_diff
    current = ("-A -t 10.96.0.1:443 -s rr\n-a -t 10.96.0.1:443 -r 192.168.0.2:6443 -m -w 1\n"
               "-A -t 10.100.0.5:80 -s rr\n-A -t 10.96.0.9:80 -s rr\n")
    desired = "-A -t 10.96.0.1:443 -s rr\n-a -t 10.96.0.1:443 -r 192.168.0.2:6443 -m -w 1\n"
    ours = {"10.96.0.1", "10.100.0.5", "10.96.0.9"}
    assert ipvs_diff(current, desired, ours) == "-D -t 10.100.0.5:80\n-D -t 10.96.0.9:80\n"
    assert ipvs_diff(current, desired, ours, ("10.100.0.0/16",)) == "-D -t 10.96.0.9:80\n"
