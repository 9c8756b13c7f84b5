import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from clusterdns.config import OPTION_SECTION, SECTIONS, Config, ConfigError, build_parser, load, parse_hostport


def test_defaults_and_demo():
    cfg = load(["agent"], env={})
    assert cfg.source.demo and not cfg.applying
    assert cfg.dns.zones == ("cluster.local", "in-addr.arpa", "ip6.arpa")
    assert cfg.dns.ttl == 5 and cfg.dns.pods == "insecure"
    assert cfg.listen_addresses() == [("127.0.0.1", 5353)]
    # The demo runs as the demo cluster's node-a, unless told otherwise.
    assert (cfg.proxy.node_name, cfg.proxy.node_ips, cfg.proxy.cluster_cidrs) == ("node-a", ("192.168.49.2",), ("10.161.0.0/16",))
    assert load(["rules", "--node-name", "node-b"], env={}).proxy.node_name == "node-b"
    assert load(["rules", "--manifest", "x.yaml"], env={}).proxy.node_name == ""


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("apiVersion: clusterdns/v1\nkind: ClusterDNSConfiguration\nttl: 30\nzone: [example.org]\n"
                 "node-ip: [10.0.0.1]\nproxy_mode: nftables\n")
    cfg = load(["dns", "--config", str(f), "--ttl", "7", "--manifest", "x.yaml"], env={})
    assert cfg.dns.ttl == 7 and cfg.dns.zones == ("example.org",) and cfg.proxy.node_ips == ("10.0.0.1",)
    assert cfg.proxy.proxy_mode == "nftables" and not cfg.source.demo and cfg.applying


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
    assert cfg.proxy.node_name == "n1" and cfg.source.kubeconfig == "/k" and not cfg.source.demo


@pytest.mark.parametrize("argv", [["dns", "--ttl", "x"], ["bogus"], ["dns", "--manifest", "/nonexistent.yaml"]])
def test_cli_exit_code_2_with_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "clusterdns", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("clusterdns:")


def _option_actions():
    """(command, dest) of every option each command's parser takes."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help":
                yield command, action


def test_every_flag_lands_in_exactly_one_section():
    sections = {name: {f.name for f in fields(cls)} for name, cls in SECTIONS.items()}
    seen = set()
    for command, action in _option_actions():
        if action.dest.startswith("kp_"):
            continue   # kube-proxy's flags, made options by kpconfig.apply
        dest = "trace_resolv_conf" if (command, action.dest) == ("trace", "resolv_conf") else action.dest
        homes = [s for s, names in sections.items() if dest in names]
        assert len(homes) == 1, f"{command} {action.option_strings or dest}: in sections {homes}"
        seen.add(dest)
    # Every option of a section is a flag, but the derived demo and these, set in the --config file only.
    assert set().union(*sections.values()) - seen == {"demo", "udp_size", "cache_max_ttl", "cache_min_ttl",
                                                      "corefile_flags",
                                                      "conntrack"}   # the --conntrack-* flags
    assert set(OPTION_SECTION) == set().union(*sections.values())


def test_file_only_options_land_in_their_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("udp-size: 1400\ncache_max_ttl: 60\ncache_min_ttl: 1\nlameduck: 2\nmanifest_max_objects: 7\n")
    cfg = load(["dns", "--config", str(f)], env={})
    assert (cfg.dns.udp_size, cfg.dns.cache_max_ttl, cfg.dns.cache_min_ttl) == (1400, 60, 1)
    assert cfg.agent.lameduck == 2 and cfg.source.manifest_max_objects == 7


def test_a_flag_sets_its_own_section_only():
    base = load(["agent"], env={})
    cfg = load(["agent", "--ttl", "9"], env={})
    assert cfg.dns.ttl == 9
    assert (cfg.source, cfg.proxy, cfg.agent, cfg.run) == (base.source, base.proxy, base.agent, base.run)
    assert Config.from_options(ttl=9, masquerade_all=True) == Config().with_options(ttl=9).with_options(
        masquerade_all=True)
    with pytest.raises(TypeError, match="unknown option"):
        Config().with_options(no_such_option=1)


def _changed(value):
    """Some other valid value of an option's type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, tuple) or value is None:
        return ("10.9.9.9",)
    return value + "-x"


# What a reload restarts when one option of a section changes. The agent section's
# lifecycle options restart nothing; its listeners restart the health server.
RESTARTS = {"source": {"source"}, "dns": {"dns"}, "proxy": {"proxy"}, "run": set()}
ACROSS = {  # the options a second component reads too (agent.component_inputs)
    "pods": {"dns", "source"}, "autopath": {"dns", "source"},       # the source watches Pods
    "node_name": {"proxy", "source"},                               # the source watches that Node
    "proxy_mode": {"proxy", "health"},                              # /proxyMode, the proxy metrics
    "apply": {"proxy", "localdns"},                                 # local addresses only when applying
    "local_ips": {"dns", "localdns"},
    "demo": {"source", "proxy", "localdns"},                        # applying (base listens on local_ips)
    "health_listen": {"health"}, "metrics_listen": {"health"}, "proxy_metrics_listen": {"health"},
    "ready_listen": {"health"},
    "proxy_health_listen": {"health"}, "bind_address_hard_fail": {"health"},
    "config_file": {"dns"},                                         # coredns_plugin_enabled{name="reload"}
}


SPECIAL = {"zones": ("example.org",), "pods": "verified", "proxy_mode": "nftables", "apply": False,
           "health_listen": "127.0.0.1:1", "metrics_listen": "127.0.0.1:2", "proxy_metrics_listen": "127.0.0.1:3",
           "ready_listen": "127.0.0.1:4", "proxy_health_listen": "127.0.0.1:5"}


def test_reload_restarts_follow_sections():
    from clusterdns.agent import restarts
    base = Config.from_options(manifest=("m.yaml",), local_ips=("10.0.0.10",), node_name="n1")
    for name, section in OPTION_SECTION.items():
        value = base.options()[name]
        new = base.with_options(**{name: SPECIAL.get(name, _changed(value))})
        want = ACROSS.get(name, RESTARTS.get(section, set()))
        assert restarts(base, new) == want, name
    assert restarts(base, base.with_options(lameduck=9.0, log_level="debug", loop="asyncio")) == set()
    # turning the health or metrics listener off changes the plugins DNS reports enabled
    assert restarts(base, base.with_options(health_listen="none")) == {"health", "dns"}
    assert restarts(base, base.with_options(metrics_listen="none")) == {"health", "dns"}
