import subprocess
import sys

import pytest

from clusterdns.config import ConfigError, load, parse_hostport


def test_defaults_and_demo():
    cfg = load(["agent"], env={})
    assert cfg.demo and not cfg.applying
    assert cfg.zones == ("cluster.local", "in-addr.arpa", "ip6.arpa")
    assert cfg.ttl == 5 and cfg.pods == "insecure"
    assert cfg.listen_addresses() == [("127.0.0.1", 5353)]
    # The demo runs as the demo cluster's node-a, unless told otherwise.
    assert (cfg.node_name, cfg.node_ips, cfg.cluster_cidrs) == ("node-a", ("192.168.49.2",), ("10.161.0.0/16",))
    assert load(["rules", "--node-name", "node-b"], env={}).node_name == "node-b"
    assert load(["rules", "--manifest", "x.yaml"], env={}).node_name == ""


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("apiVersion: clusterdns/v1\nkind: ClusterDNSConfiguration\nttl: 30\nzone: [example.org]\n"
                 "node-ip: [10.0.0.1]\nproxy_mode: nftables\n")
    cfg = load(["dns", "--config", str(f), "--ttl", "7", "--manifest", "x.yaml"], env={})
    assert cfg.ttl == 7 and cfg.zones == ("example.org",) and cfg.node_ips == ("10.0.0.1",)
    assert cfg.proxy_mode == "nftables" and not cfg.demo and cfg.applying


@pytest.mark.parametrize("argv,reason", [
    (["dns", "--ttl", "4000"], "--ttl"),
    (["dns", "--listen", "1.2.3.4:99999"], "port out of range"),
    (["dns", "--listen", "nohost:53"], "not an IP address"),
    (["proxy", "--node-ip", "300.1.1.1"], "not an IP"),
    (["proxy", "--cluster-cidr", "10.0.0.0/33"], "not a CIDR"),
    (["dns", "--namespaces", "a", "--namespace-labels", "x=y"], "cannot be combined"),
])
def test_bad_values(argv, reason):
    with pytest.raises(ConfigError, match=reason):
        load(argv, env={})


def test_bad_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ttl: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load(["dns", "--config", str(f)], env={})
    f.write_text("no_such_option: 1\n")
    with pytest.raises(ConfigError, match="unknown option"):
        load(["dns", "--config", str(f)], env={})
    f.write_text("ttl: five\n")
    with pytest.raises(ConfigError, match="expected a number"):
        load(["dns", "--config", str(f)], env={})


def test_hostport_forms():
    assert parse_hostport("[::1]:5353", 53) == ("::1", 5353)
    assert parse_hostport("::1", 53) == ("::1", 53)
    assert parse_hostport(":53", 0) == ("0.0.0.0", 53)
    assert parse_hostport("10.0.0.1", 53) == ("10.0.0.1", 53)


def test_environment_sources():
    cfg = load(["proxy"], env={"NODE_NAME": "n1", "KUBECONFIG": "/k"})
    assert cfg.node_name == "n1" and cfg.kubeconfig == "/k" and not cfg.demo


@pytest.mark.parametrize("argv", [["dns", "--ttl", "x"], ["bogus"], ["dns", "--manifest", "/nonexistent.yaml"]])
def test_cli_exit_code_2_with_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "clusterdns", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("clusterdns:")
