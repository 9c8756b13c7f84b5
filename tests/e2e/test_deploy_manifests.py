"""deploy/ parses, holds the expected objects, and asks for no more than it reads."""
import os

import yaml

from clusterdns.config import load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")


def _docs():
    out = []
    for name in sorted(os.listdir(DEPLOY)):
        if name.endswith((".yaml", ".yml")):
            with open(os.path.join(DEPLOY, name)) as fh:
                out += [(name, d) for d in yaml.safe_load_all(fh) if d is not None]
    return out


def _by_kind():
    return {d["kind"]: d for _, d in _docs()}


def test_every_document_has_kind_and_api_version():
    docs = _docs()
    assert docs
    for name, d in docs:
        assert isinstance(d, dict) and d.get("kind") and d.get("apiVersion"), name
    kinds = {d["kind"] for _, d in docs}
    assert {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "ConfigMap", "Cluster"} <= kinds


def test_rbac_reads_only():
    role = _by_kind()["ClusterRole"]
    granted = {}
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted[(group, res)] = set(rule["verbs"])
    assert granted[("", "services")] == {"list", "watch"}
    assert granted[("discovery.k8s.io", "endpointslices")] == {"list", "watch"}
    assert granted[("", "namespaces")] == {"list", "watch"}
    assert granted[("", "nodes")] == {"get", "list", "watch"}
    assert set(r for _, r in granted) <= {"services", "endpointslices", "namespaces", "pods", "nodes"}
    binding = _by_kind()["ClusterRoleBinding"]
    sa = _by_kind()["ServiceAccount"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]


def test_daemonset_shape():
    ds = _by_kind()["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "Default"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    c = spec["containers"][0]
    caps = c["securityContext"]["capabilities"]
    assert {"NET_ADMIN", "NET_RAW"} <= set(caps["add"]) and caps["drop"] == ["ALL"]
    assert not c["securityContext"].get("privileged")
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/run/xtables.lock", "/lib/modules"} <= mounts
    assert spec["serviceAccountName"] == _by_kind()["ServiceAccount"]["metadata"]["name"]


def test_config_file_is_accepted_by_the_agent(tmp_path):
    cm = _by_kind()["ConfigMap"]
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = load(["agent", "--config", str(path), "--kubeconfig", "/nonexistent"], env={})
    assert cfg.dns.local_ips == ("10.96.0.10", "169.254.20.10")
    assert cfg.proxy.proxy_mode == "iptables"
    ds = _by_kind()["DaemonSet"]
    grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > max(cfg.agent.lameduck, cfg.agent.lameduck_handover)
    # Old and new pods overlap during a rollout (the hand-over needs both running).
    rolling = ds["spec"]["updateStrategy"]["rollingUpdate"]
    assert rolling["maxSurge"] == 1 and rolling["maxUnavailable"] == 0
    # The probes point at the port the config serves health on.
    probe_port = ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"]
    assert cfg.agent.health_listen.endswith(f":{probe_port}")


def test_kind_cluster_replaces_kube_proxy():
    cluster = _by_kind()["Cluster"]
    assert cluster["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert cluster["networking"]["kubeProxyMode"] == "none"
    cm = _by_kind()["ConfigMap"]
    conf = yaml.safe_load(cm["data"]["config.yaml"])
    assert conf["service-cidr"] == [cluster["networking"]["serviceSubnet"]]
    assert conf["cluster-cidr"] == [cluster["networking"]["podSubnet"]]


def test_daemonset_mounts_the_clusters_own_dns_configmaps(tmp_path):
    """The coredns (with k3s's NodeHosts), coredns-custom and node-local-dns ConfigMaps are
    mounted unchanged where their own Deployments mount them; a kubeadm Corefile placed at
    the coredns mount serves with the DaemonSet's commented --corefile."""
    ds = _by_kind()["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    for name, path in (("coredns", "/etc/coredns"), ("coredns-custom", "/etc/coredns/custom"),
                       ("node-local-dns", "/etc/node-local-dns")):
        assert volumes[name]["configMap"] == {"name": name, "optional": True}
        assert mounts[name]["mountPath"] == path and mounts[name]["readOnly"] is True
    with open(os.path.join(DEPLOY, "daemonset.yaml")) as fh:
        text = fh.read()
    assert "# - --corefile=/etc/coredns/Corefile" in text and "# - --corefile=/etc/node-local-dns/Corefile" in text
    # the kubeadm Corefile, as the coredns ConfigMap holds it, checks with the agent's reader
    from clusterdns.config import Config
    from clusterdns.corefile.build import prepare
    corefile = tmp_path / "Corefile"
    with open(os.path.join(ROOT, "tests", "corefile", "real", "kubeadm.corefile")) as fh:
        corefile.write_text(fh.read())
    cf, cfg = prepare(Config.from_options("agent", corefile=str(corefile), local_ips=("10.96.0.10",)))
    assert cfg.agent.health_listen == "0.0.0.0:8080" and cfg.agent.ready_listen == "0.0.0.0:8181"
    assert cfg.listen_addresses() == [("0.0.0.0", 53), ("::", 53)]     # no bind: every address, both families
