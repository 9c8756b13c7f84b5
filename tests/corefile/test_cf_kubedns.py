"""kube-dns ConfigMap -> Corefile (clusterdns/corefile/kubedns.py and `clusterdns corefile`).

Cases follow kubeadm's translation tests (kubernetes/kubernetes cmd/kubeadm/app/phases/addons/dns
dns_test.go @ 99600aa, TestTranslateStubDomainKubeDNSToCoreDNS / TestTranslateUpstreamKubeDNSToCoreDNS),
the GKE / k8s-docs ConfigMaps in real/gke-kube-dns.configmap.yaml and the docs'
CoreDNS equivalent (k8s-docs-kubedns-equivalent.corefile).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterdns.config import ConfigError, load
from clusterdns.corefile.keys import bind_addresses, check_duplicates, parse_keys
from clusterdns.corefile.kubedns import KubeDNSError, corefile_from_kube_dns, data_from_yaml, read, server_kind
from clusterdns.corefile.parse import parse_text, walk

# Verbatim copies of /work/shared/reference/corefiles/real/ (each names its source in its header).
REAL = Path(__file__).resolve().parent / "real"
ROOT = Path(__file__).resolve().parents[2]


def _real(name: str) -> str:
    return (REAL / name).read_text()


def blocks(text: str) -> dict[str, list[list[str]]]:
    """The Corefile read by clusterdns's own parser: server block key -> its lines (nested
    lines included, depth first) as [name, *args]. Its keys must pass CoreDNS's startup checks."""
    parsed = parse_text(text, env={})
    check_duplicates([(parse_keys(b), bind_addresses(b)) for b in parsed])
    return {" ".join(t.text for t in b.keys): [[d.name, *d.values] for d in walk(b.directives)] for b in parsed}


def cm(**data: object) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}


MAIN_GKE1 = """\
.:53 {
    errors
    health {
       lameduck 5s
    }
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }
    prometheus :9153
    forward . 8.8.8.8 8.8.4.4 {
       max_concurrent 1000
    }
    cache 30 {
       disable success cluster.local
       disable denial cluster.local
    }
    loop
    reload
    loadbalance
}

acme.local:53 {
    errors
    cache 30
    loop
    forward . 1.2.3.4 {
       max_concurrent 1000
    }
}
"""


def gke_examples() -> list[dict]:
    return [d for d in yaml.safe_load_all(_real("gke-kube-dns.configmap.yaml")) if d]


def test_gke_example_stub_and_upstreams():
    ex1 = gke_examples()[0]
    assert corefile_from_kube_dns(ex1["data"], "cluster.local") == MAIN_GKE1


def test_no_configmap_keys_is_kubeadms_default_corefile():
    # Without stubDomains/upstreamNameservers the translation is kubeadm's default Corefile.
    kubeadm = blocks(_real("kubeadm.corefile"))
    assert blocks(corefile_from_kube_dns({}, "cluster.local")) == kubeadm


def test_gke_stub_only_and_upstream_only():
    ex2, ex3 = gke_examples()[1:3]
    out2 = blocks(corefile_from_kube_dns(ex2["data"], "cluster.local"))
    assert list(out2) == [".:53", "consul.local:53"]
    assert ["forward", ".", "/etc/resolv.conf"] in out2[".:53"]
    assert out2["consul.local:53"] == [["errors"], ["cache", "30"], ["loop"],
                                       ["forward", ".", "10.150.0.1"], ["max_concurrent", "1000"]]
    out3 = blocks(corefile_from_kube_dns(ex3["data"], "cluster.local"))
    assert list(out3) == [".:53"]
    assert ["forward", ".", "172.16.0.1"] in out3[".:53"]


def test_k8s_docs_equivalent_without_federation():
    """The docs' translation of example 4, less its federation (refused, see below): the same
    server blocks, each stub block holding the docs' lines (we add kubeadm's loop and migration's
    max_concurrent), and the same upstreams."""
    ex4 = dict(gke_examples()[3]["data"])
    del ex4["federations"]
    docs = blocks(_real("k8s-docs-kubedns-equivalent.corefile"))
    ours = blocks(corefile_from_kube_dns(ex4, "cluster.local"))
    assert list(ours) == list(docs) == [".:53", "abc.com:53", "my.cluster.local:53"]
    for key in ("abc.com:53", "my.cluster.local:53"):
        assert all(line in ours[key] for line in docs[key]), key
        assert ["loop"] in ours[key] and ["max_concurrent", "1000"] in ours[key]
    fwd = [ln for ln in docs[".:53"] if ln[0] == "forward"]
    assert fwd == [["forward", ".", "8.8.8.8", "8.8.4.4"]]
    assert fwd[0] in ours[".:53"]
    # The docs' kubernetes stanza, as kubeadm writes it today (ttl 30 added).
    assert ["kubernetes", "cluster.local", "in-addr.arpa", "ip6.arpa"] in ours[".:53"]
    assert ["fallthrough", "in-addr.arpa", "ip6.arpa"] in ours[".:53"]


def test_federations_refused():
    ex4 = gke_examples()[3]["data"]
    with pytest.raises(KubeDNSError, match=r"^federations: .*federation plugin.*1\.6\.3"):
        corefile_from_kube_dns(ex4, "cluster.local")
    # An empty federation map loses nothing.
    assert corefile_from_kube_dns(cm(federations={}), "cluster.local") == corefile_from_kube_dns({}, "cluster.local")


# kubeadm TestTranslateStubDomainKubeDNSToCoreDNS: server lists kept as written, host names
# left out, a stub with no IP left gets no block.
@pytest.mark.parametrize("stubs,expected", [
    ({"foo.com": ["1.2.3.4:5300", "3.3.3.3"], "my.cluster.local": ["2.3.4.5"]},
     {"foo.com:53": ["1.2.3.4:5300", "3.3.3.3"], "my.cluster.local:53": ["2.3.4.5"]}),
    ({"foo.com": ["1.2.3.4:5300"], "my.cluster.local": ["2.3.4.5"]},
     {"foo.com:53": ["1.2.3.4:5300"], "my.cluster.local:53": ["2.3.4.5"]}),
    ({"bar.com": ["1.2.3.4:5300", "service.consul"], "my.cluster.local": ["2.3.4.5"], "foo.com": ["service.consul"]},
     {"bar.com:53": ["1.2.3.4:5300"], "my.cluster.local:53": ["2.3.4.5"]}),
    ({"foo.com": ["service.consul"], "my.cluster.local": ["ns.foo.com"]}, {}),
    (None, {}),
])
def test_kubeadm_stub_domain_cases(stubs, expected):
    data = cm(upstreamNameservers=["8.8.8.8", "8.8.4.4"])
    if stubs is not None:
        data.update(cm(stubDomains=stubs))
    out = blocks(corefile_from_kube_dns(data, "cluster.local"))
    stub_keys = [k for k in out if k != ".:53"]
    assert stub_keys == list(expected)   # JSON order, where kubeadm's Go map order was random
    for key, servers in expected.items():
        assert out[key] == [["errors"], ["cache", "30"], ["loop"], ["forward", ".", *servers],
                            ["max_concurrent", "1000"]]


def test_host_names_are_noted():
    notes: list[str] = []
    data = cm(stubDomains={"bar.com": ["1.2.3.4:5300", "service.consul"], "foo.com": ["service.consul"]})
    corefile_from_kube_dns(data, "cluster.local", notes=notes)
    assert notes == [
        "stubDomains: 'bar.com': 'service.consul' left out: a host name, and forward takes IP addresses",
        "stubDomains: 'foo.com': 'service.consul' left out: a host name, and forward takes IP addresses",
        "stubDomains: 'foo.com' left out: no IP address to forward to",
    ]


# kubeadm TestTranslateUpstreamKubeDNSToCoreDNS
@pytest.mark.parametrize("upstreams,forward", [
    (None, ["/etc/resolv.conf"]),
    (["8.8.8.8", "8.8.4.4", "4.4.4.4"], ["8.8.8.8", "8.8.4.4", "4.4.4.4"]),
    (["8.8.8.8", "8.8.4.4"], ["8.8.8.8", "8.8.4.4"]),
    (["service.consul", "ns.foo.com", "8.8.4.4", "ns.moo.com", "ns.bar.com"], ["8.8.4.4"]),
    (["[2003::1]:53", "8.8.4.4"], ["[2003::1]:53", "8.8.4.4"]),
    (["2003::1", "10.0.0.1:5353"], ["2003::1", "10.0.0.1:5353"]),
    ([], ["/etc/resolv.conf"]),
])
def test_kubeadm_upstream_cases(upstreams, forward):
    data = {} if upstreams is None else cm(upstreamNameservers=upstreams)
    main = blocks(corefile_from_kube_dns(data, "cluster.local"))[".:53"]
    assert [ln for ln in main if ln[0] == "forward"] == [["forward", ".", *forward]]


def test_all_host_name_upstreams_fall_back_to_resolv_conf():
    # kubeadm printed "forward . " (no target, a Corefile CoreDNS refuses); kube-dns without
    # upstreams uses the node's resolv.conf, so that is what the translation forwards to, and says so.
    notes: list[str] = []
    out = corefile_from_kube_dns(cm(upstreamNameservers=["service.consul", "ns.foo.com"]), "cluster.local",
                                 notes=notes)
    assert ["forward", ".", "/etc/resolv.conf"] in blocks(out)[".:53"]
    assert notes[-1] == "upstreamNameservers: no IP address left; forwarding to /etc/resolv.conf " \
                        "as kube-dns does without the key"
    assert len(notes) == 3


def test_cluster_domain_option():
    out = corefile_from_kube_dns(cm(stubDomains={"cluster.local": ["10.0.0.1"]}), "Example.ORG.")
    b = blocks(out)
    assert ["kubernetes", "example.org", "in-addr.arpa", "ip6.arpa"] in b[".:53"]
    assert ["disable", "success", "example.org"] in b[".:53"] and ["disable", "denial", "example.org"] in b[".:53"]
    assert "cluster.local:53" in b   # no longer the cluster domain: an ordinary stub


@pytest.mark.parametrize("data,message", [
    (cm(stubDomains='{"acme.local": ["1.2.3.4"]'), r"^stubDomains: invalid JSON"),
    (cm(upstreamNameservers='["8.8.8.8",]'), r"^upstreamNameservers: invalid JSON"),
    (cm(federations="{foo}"), r"^federations: invalid JSON"),
    (cm(stubDomains=["1.2.3.4"]), r"^stubDomains: expected a JSON object"),
    (cm(stubDomains={"acme.local": "1.2.3.4"}), r"^stubDomains: 'acme.local': expected a list"),
    (cm(upstreamNameservers={"a": "8.8.8.8"}), r"^upstreamNameservers: expected a JSON list"),
    (cm(upstreamNameservers=[8888]), r"^upstreamNameservers: expected a JSON list of nameserver strings"),
    (cm(upstreamNameservers=["1.2.3.999"]), r"^upstreamNameservers: invalid nameserver '1\.2\.3\.999'"),
    (cm(upstreamNameservers=["8.8.8.8:70000"]), r"^upstreamNameservers: invalid nameserver '8\.8\.8\.8:70000'"),
    (cm(upstreamNameservers=["8.8.8.8:0"]), r"invalid nameserver '8\.8\.8\.8:0'"),
    (cm(upstreamNameservers=["[2003::1]"]), r"invalid nameserver '\[2003::1\]'"),
    (cm(upstreamNameservers=["[8.8.8.8]:53"]), r"invalid nameserver '\[8\.8\.8\.8\]:53'"),
    (cm(upstreamNameservers=["fe80::1%eth0"]), r"invalid nameserver 'fe80::1%eth0'"),
    (cm(upstreamNameservers=["dns.example:53"]), r"invalid nameserver 'dns\.example:53'"),
    (cm(upstreamNameservers=[" 8.8.8.8"]), r"invalid nameserver ' 8\.8\.8\.8'"),
    (cm(stubDomains={"acme.local": ["300.1.1.1"]}), r"^stubDomains: 'acme.local': invalid nameserver '300\.1\.1\.1'"),
    (cm(stubDomains={"Acme.local": ["1.1.1.1"]}), r"^stubDomains: invalid domain name 'Acme\.local'"),
    (cm(stubDomains={"acme.local.": ["1.1.1.1"]}), r"^stubDomains: invalid domain name 'acme\.local\.'"),
    (cm(stubDomains={"cluster.local": ["1.1.1.1"]}), r"^stubDomains: 'cluster\.local' is the cluster domain"),
    (cm(upstreamNameservers=[f"10.0.0.{i}" for i in range(1, 17)]), r"^upstreamNameservers: 16 nameservers"),
    ({"stubdomains": '{"a.b": ["1.1.1.1"]}'}, r"^stubdomains: not a key kube-dns reads"),
    ({"upstreamNameservers": ["8.8.8.8"]}, r"^upstreamNameservers: expected a JSON string .* got a YAML list"),
])
def test_bad_input_names_the_key(data, message):
    with pytest.raises(KubeDNSError, match=message):
        corefile_from_kube_dns(data, "cluster.local")


def test_empty_or_null_values_are_unset():
    # Go's json.Unmarshal takes null as "not set"; an empty value carries nothing either.
    assert read({"stubDomains": "null", "upstreamNameservers": "  \n"}) == read({})


def test_server_kinds():
    assert [server_kind(s) for s in ("1.2.3.4", "1.2.3.4:53", "2001:db8::1", "[2001:db8::1]:5353")] == ["ip"] * 4
    assert [server_kind(s) for s in ("service.consul", "ns1")] == ["name"] * 2
    bad = ("1.2.3", "01.2.3.4", "a_b.com", "", ":53", "1.2.3.4:", "1.2.3.4:\u0665\u0663", "\u0661.2.3.4")
    assert [server_kind(s) for s in bad] == ["bad"] * len(bad)


def test_yaml_forms():
    obj = data_from_yaml("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: kube-dns}\n"
                         "data:\n  upstreamNameservers: |\n    [\"1.1.1.1\"]\n", "f")
    assert obj == {"upstreamNameservers": '["1.1.1.1"]\n'}
    assert data_from_yaml('stubDomains: \'{"a.b": ["1.1.1.1"]}\'\n', "f") == {"stubDomains": '{"a.b": ["1.1.1.1"]}'}
    assert data_from_yaml("kind: ConfigMap\n", "f") == {}
    with pytest.raises(KubeDNSError, match=r"^f:3: invalid YAML"):
        data_from_yaml("data:\n  a: b\n   c: [\n", "f")
    with pytest.raises(KubeDNSError, match=r"^f: kind 'Service'; expected a ConfigMap"):
        data_from_yaml("kind: Service\n", "f")
    with pytest.raises(KubeDNSError, match=r"^f: 2 YAML documents"):
        data_from_yaml("a: 1\n---\nb: 2\n", "f")
    with pytest.raises(KubeDNSError, match=r"^f: empty"):
        data_from_yaml("# nothing\n", "f")
    with pytest.raises(KubeDNSError, match=r"^f: expected a ConfigMap or a mapping"):
        data_from_yaml("- a\n", "f")


def test_corefile_keys_are_not_agent_config_keys(tmp_path):
    # The corefile command's options are flags only: a --config file naming them is refused,
    # not silently ignored by the agent.
    f = tmp_path / "c.yaml"
    f.write_text("cluster_domain: example.org\n")
    with pytest.raises(ConfigError, match="unknown option 'cluster_domain'"):
        load(["agent", "--config", str(f)], env={})


# --- the command, as a user runs it ---

def clusterdns(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "clusterdns", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)


def test_cli_translates_the_gke_configmap(tmp_path):
    f = tmp_path / "kube-dns.yaml"
    f.write_text(yaml.safe_dump(gke_examples()[0]))
    r = clusterdns("corefile", "--from-kube-dns", str(f))
    assert (r.returncode, r.stdout, r.stderr) == (0, MAIN_GKE1, "")


def test_cli_stdin_data_mapping_domain_and_notes():
    data = 'stubDomains: |\n  {"acme.local": ["1.2.3.4", "ns.acme.local"]}\n'
    r = clusterdns("corefile", "--from-kube-dns", "-", "--cluster-domain", "k8s.example", stdin=data)
    assert r.returncode == 0, r.stderr
    assert r.stdout == corefile_from_kube_dns(yaml.safe_load(data), "k8s.example")
    assert "kubernetes k8s.example in-addr.arpa ip6.arpa {" in r.stdout
    assert r.stderr == ("clusterdns: <stdin>: stubDomains: 'acme.local': 'ns.acme.local' left out: "
                        "a host name, and forward takes IP addresses\n")


@pytest.mark.parametrize("content,args,reason", [
    ("data: [\n", (), r"^clusterdns: {f}:2: invalid YAML"),
    ('upstreamNameservers: \'["8.8.8.8", ]\'\n', (), r"^clusterdns: {f}: upstreamNameservers: invalid JSON"),
    ('upstreamNameservers: \'["8.8.8.888"]\'\n', (), r"^clusterdns: {f}: upstreamNameservers: invalid nameserver"),
    ('federations: \'{"foo": "foo.feddomain.com"}\'\n', (), r"^clusterdns: {f}: federations: not translatable"),
    ("{}\n", ("--cluster-domain", "bad_domain"), r"^clusterdns: --cluster-domain 'bad_domain': not a DNS name"),
    (None, (), r"^clusterdns: {f}: No such file or directory"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, content, args, reason):
    import re
    f = tmp_path / "kube-dns.yaml"
    if content is not None:
        f.write_text(content)
    r = clusterdns("corefile", "--from-kube-dns", str(f), *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert re.match(reason.format(f=re.escape(str(f))), r.stderr), r.stderr


def test_cli_usage():
    r = clusterdns("corefile", "--help")
    assert r.returncode == 0 and "--from-kube-dns FILE" in r.stdout and "--cluster-domain" in r.stdout
    assert "--manifest" not in r.stdout   # reads no cluster state
    r = clusterdns("corefile")
    assert r.returncode == 2 and r.stderr == "clusterdns: corefile: nothing to translate; give --from-kube-dns FILE\n"
    r = clusterdns("corefile", "--from-kube-dns", "x.yaml", "--manifest", "y.yaml")
    assert r.returncode == 2 and "unrecognized arguments: --manifest" in r.stderr
