"""deploy/ with the cluster's own kube-proxy ConfigMap mounted, and `clusterdns config check`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterdns.config import load
from clusterdns.health import plan

ROOT = Path(__file__).resolve().parents[2]
REAL = Path("/work/shared/reference/kubeproxy-config/real")
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="reference configs not present")


def _daemonset() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "daemonset.yaml").read_text())


def _project(configmap: dict, into: Path) -> Path:
    """The ConfigMap's keys as files, as the kubelet mounts a configMap volume."""
    into.mkdir()
    for key, value in configmap["data"].items():
        (into / key).write_text(value)
    return into


def test_daemonset_mounts_the_kube_proxy_configmap_where_kube_proxy_has_it():
    spec = _daemonset()["spec"]["template"]["spec"]
    [vol] = [v for v in spec["volumes"] if v["name"] == "kube-proxy"]
    assert vol["configMap"] == {"name": "kube-proxy", "optional": True}
    [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "kube-proxy"]
    assert mount["mountPath"] == "/var/lib/kube-proxy" and mount["readOnly"] is True
    assert "--proxy-config=/var/lib/kube-proxy/config.conf" in (ROOT / "deploy" / "daemonset.yaml").read_text()


@needs_real
def test_the_agent_starts_on_kubeadms_configmap_beside_deploys_config(tmp_path):
    """The DaemonSet's args with --proxy-config on, on the kubeadm ConfigMap as the kubelet projects it."""
    ours = yaml.safe_load((ROOT / "deploy" / "configmap.yaml").read_text())
    (tmp_path / "config.yaml").write_text(ours["data"]["config.yaml"])
    mounted = _project(yaml.safe_load((REAL / "kubeadm-configmap.yaml").read_text()), tmp_path / "kube-proxy")
    cfg = load(["agent", f"--config={tmp_path / 'config.yaml'}", "--node-ip=10.0.0.5",
                f"--proxy-config={mounted / 'config.conf'}", "--kubeconfig", "/nonexistent"],
               env={"NODE_NAME": "Worker-1"})
    px = cfg.proxy
    assert (px.proxy_mode, px.cluster_cidrs, px.node_name, px.node_ips) == \
        ("iptables", ("10.244.0.0/16",), "worker-1", ())
    assert px.service_cidrs == ("10.96.0.0/16",) and cfg.dns.local_ips == ("10.96.0.10", "169.254.20.10")
    # kube-proxy's healthz port is the probes' port: one listener serves /health, /ready, /healthz, /livez
    listeners = {(lst.host, lst.port): lst for lst in plan(cfg, ("dns", "proxy"))}
    probe = _daemonset()["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"]
    health = listeners[("0.0.0.0", probe)]
    assert health.health and "proxy-health" in health.kinds
    assert "proxy-metrics" in listeners[("127.0.0.1", 10249)].kinds    # the file's metricsBindAddress


@needs_real
def test_eks_configmap_key_config(tmp_path):
    eks = next(d for d in yaml.safe_load_all((REAL / "eks.yaml").read_text()) if d and d["kind"] == "ConfigMap")
    mounted = _project(eks, tmp_path / "kube-proxy-config")
    cfg = load(["agent", f"--proxy-config={mounted / 'config'}", "--kubeconfig", "/nonexistent"], env={})
    assert cfg.agent.proxy_metrics_listen == "0.0.0.0:10249" and cfg.proxy.oom_score_adj == -998


def check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterdns", "config", "check", *argv],
                          capture_output=True, text=True, timeout=60)


def _rows(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines()[1:]:
        name, _, rest = line.partition("  ")
        rows[name.strip()] = " ".join(rest.split())
    return rows


@needs_real
def test_config_check_prints_the_effective_settings_and_their_fields():
    proc = check("--proxy-config", str(REAL / "kubespray.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("KubeProxyConfiguration kubeproxy.config.k8s.io/v1alpha1, valid")
    rows = _rows(proc.stdout)
    assert rows["mode"].startswith("ipvs")
    assert rows["node name"].startswith("node1 ")
    assert rows["sync period"] == "30s # ipvs.syncPeriod"
    assert rows["min sync period"] == "0s # ipvs.minSyncPeriod"
    assert rows["masquerade bit"] == "14 (mark 0x4000) # iptables.masqueradeBit"
    assert rows["ipvs scheduler"] == "rr # ipvs.scheduler"
    assert rows["local traffic"].startswith("source in 10.233.64.0/18")
    assert rows["healthz"].startswith("0.0.0.0:10256 (/healthz, /livez)")
    assert rows["tcp established timeout"] == "86400s # conntrack.tcpEstablishedTimeout"
    assert rows["oom_score_adj"] == "-999 # oomScoreAdj"


@needs_real
def test_config_check_of_eks_names_what_was_ignored():
    rows = _rows(check("--proxy-config", str(REAL / "eks.yaml")).stdout)
    assert 'unknown field "udpIdleTimeout"' in rows["lenient decoding"]
    assert "clientConnection.kubeconfig" in rows["not applied"]
    assert rows["metrics"].startswith("0.0.0.0:10249")


@needs_real
def test_config_check_of_k3s_flags():
    args = yaml.safe_load((REAL / "k3s-args.yaml").read_text())["args"]
    proc = check(*args)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert rows["nf_conntrack_max"].startswith("left alone (maxPerCore 0)")
    assert rows["tcp established timeout"].startswith("left alone (0)")
    assert rows["healthz"].startswith("127.0.0.1:10256")
    assert rows["node name"].startswith("node1")


def test_config_check_of_a_bad_file_exits_2_naming_the_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                 "conntrack: {maxPerCore: -1}\n")
    proc = check("--proxy-config", str(f))
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert "KubeProxyConfiguration.KubeProxyLinuxConfiguration.KubeProxyConntrackConfiguration.MaxPerCore: " \
           "Invalid value: -1" in line


def test_config_check_names_the_interface_detector(tmp_path):
    f = tmp_path / "bridge.yaml"
    f.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                 "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\nclusterCIDR: 10.9.0.0/16\n")
    rows = _rows(check("--proxy-config", str(f), "--node-name", "n").stdout)
    assert rows["local traffic"] == "in on cbr0 # detectLocalMode, detectLocal.bridgeInterface"


def test_bind_address_hard_fail(tmp_path):
    """bindAddressHardFail: a healthz address that cannot be bound ends the process; without it the
    listener is retried every 5 s while the proxier runs (kube-proxy's two behaviours)."""
    import select
    import socket
    import time
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    f = tmp_path / "kp.yaml"
    base = ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
            f"healthzBindAddress: 127.0.0.1:{port}\nmetricsBindAddress: 127.0.0.1:{free}\n")
    argv = [sys.executable, "-m", "clusterdns", "proxy", "--proxy-config", str(f), "--dry-run",
            "--manifest", str(ROOT / "clusterdns" / "demo" / "cluster.yaml"), "--health-listen", "none"]
    try:
        f.write_text(base + "bindAddressHardFail: true\n")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        f.write_text(base)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen = []
        try:
            # Wait for the line rather than a fixed time: a loaded machine starts the process slowly.
            # (select: a process that stays silent must fail the test, not hang it)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if not select.select([proc.stderr], [], [], 1)[0]:
                    continue
                line = proc.stderr.readline()
                seen.append(line)
                if "retrying every 5s" in line:
                    break
            assert proc.poll() is None, "".join(seen)
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        err = "".join(seen) + err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "retrying every 5s" in err, err
    finally:
        busy.close()
