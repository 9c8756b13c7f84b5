"""node-local-dns placeholders (clusterdns/corefile/pillars.py), against the NodeLocal Corefiles
real clusters ship (real/nodelocaldns.corefile, rke2-nodelocal.corefile, kubespray-nodelocaldns.corefile)
and node-cache's own expectations (kubernetes/dns cmd/node-cache/app/cache_app_test.go TestUpdateCoreFile,
TestUpdateIPv6CoreFile: its template, the force_tcp -> UDP rewrite, the stub-domain blocks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterdns.corefile import pillars
from clusterdns.corefile.keys import bind_addresses, check_duplicates, parse_keys
from clusterdns.corefile.kubedns import KubeDNSError
from clusterdns.corefile.parse import parse_text
from clusterdns.corefile.pillars import IN_PROCESS, PillarError, fill, has_pillars, node_cache_corefile, stub_blocks

REAL = Path(__file__).resolve().parent / "real"


def body(text: str) -> str:
    """The Corefile without its leading comment lines (the reference files' provenance headers)."""
    return "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("#"))


def parses(text: str) -> list[tuple[str, list[str]]]:
    """(key, bind addresses) of each block, read by clusterdns's parser and passing CoreDNS's
    startup checks on keys (no zone served twice on one address)."""
    blocks = parse_text(text, env={})
    check_duplicates([(parse_keys(b), bind_addresses(b)) for b in blocks])
    return [(" ".join(t.text for t in b.keys), bind_addresses(b)) for b in blocks]


def nodelocal() -> str:
    return (REAL / "nodelocaldns.corefile").read_text()


UPSTREAM_IPTABLES = """\
cluster.local:53 {
    errors
    cache {
            success 9984 30
            denial 9984 5
    }
    reload
    loop
    bind 169.254.20.10 10.96.0.10
    forward . 10.96.0.11 {
            force_tcp
    }
    prometheus :9253
    health 169.254.20.10:8080
    }
in-addr.arpa:53 {
    errors
    cache 30
    reload
    loop
    bind 169.254.20.10 10.96.0.10
    forward . 10.96.0.11 {
            force_tcp
    }
    prometheus :9253
    }
ip6.arpa:53 {
    errors
    cache 30
    reload
    loop
    bind 169.254.20.10 10.96.0.10
    forward . 10.96.0.11 {
            force_tcp
    }
    prometheus :9253
    }
.:53 {
    errors
    cache 30
    reload
    loop
    bind 169.254.20.10 10.96.0.10
    forward . /etc/resolv.conf
    prometheus :9253
    }
"""


def test_upstream_nodelocal_iptables_mode():
    # The docs' iptables-mode values: link-local 169.254.20.10, kube-dns 10.96.0.10, node-cache
    # forwarding cluster names to kube-dns-upstream (10.96.0.11), no custom upstreams.
    text = nodelocal()
    assert has_pillars(text)
    out = fill(text, local_ips=["169.254.20.10"], dns_server="10.96.0.10", cluster_domain="cluster.local",
               upstream="/etc/resolv.conf", cluster_dns="10.96.0.11")
    assert not has_pillars(out) and "__PILLAR__" not in body(out)
    assert body(out) == UPSTREAM_IPTABLES
    assert parses(out) == [(k, ["169.254.20.10", "10.96.0.10"])
                           for k in ("cluster.local:53", "in-addr.arpa:53", "ip6.arpa:53", ".:53")]


def test_upstream_nodelocal_ipvs_mode_in_process():
    # IPVS mode: the kube-dns IP is removed from bind; no ClusterIP to forward cluster names to,
    # so they are answered in-process.
    out = fill(nodelocal(), local_ips=["169.254.20.10"], dns_server=None, cluster_domain="k8s.example",
               upstream="/etc/resolv.conf", cluster_dns=None)
    lines = body(out).splitlines()
    assert not has_pillars(out)
    assert lines[0] == "k8s.example:53 {"
    assert lines.count("    bind 169.254.20.10") == 4
    assert lines.count(f"    forward . {IN_PROCESS} {{") == 3
    assert "    forward . /etc/resolv.conf" in lines
    assert "    health 169.254.20.10:8080" in lines
    assert [k for k, _ in parses(out)] == ["k8s.example:53", "in-addr.arpa:53", "ip6.arpa:53", ".:53"]


def test_in_process_marker_is_one_corefile_token():
    assert IN_PROCESS == "clusterdns:state"
    assert IN_PROCESS.split() == [IN_PROCESS] and not set(IN_PROCESS) & set('{}"#;\\')


# node-cache's cache_app_test.go templateCoreFileContents
NODE_CACHE_TEMPLATE = """
cluster.local:53 {
    errors
    cache {
            success 9984 30
            denial 9984 5
    }
    reload
    loop
    bind __PILLAR__LOCAL__DNS__
    forward . __PILLAR__CLUSTER__DNS__ {
            force_tcp
    }
    prometheus :9253
    }
.:53 {
    errors
    cache 30
    reload
    loop
    bind __PILLAR__LOCAL__DNS__ __PILLAR__DNS__SERVER__
    forward . __PILLAR__UPSTREAM__SERVERS__ {
            force_tcp
    }
    prometheus :9253
    }
"""


def test_node_cache_template_default_upstream_keeps_tcp():
    out = fill(NODE_CACHE_TEMPLATE, local_ips=["169.254.20.10", "10.0.0.10"], dns_server=None,
               cluster_domain="cluster.local", upstream="/etc/resolv.conf", cluster_dns="9.10.11.12")
    expected = (NODE_CACHE_TEMPLATE.replace("__PILLAR__LOCAL__DNS__", "169.254.20.10 10.0.0.10")
                .replace("__PILLAR__CLUSTER__DNS__", "9.10.11.12")
                .replace("__PILLAR__UPSTREAM__SERVERS__", "/etc/resolv.conf")
                .replace(" __PILLAR__DNS__SERVER__", ""))
    assert out == expected
    assert "forward . /etc/resolv.conf {\n            force_tcp\n    }" in out


@pytest.mark.parametrize("ips,servers,cluster", [
    (["169.254.20.10", "10.0.0.10"], ["2.2.2.2:10053", "3.3.3.3"], "9.10.11.12"),
    (["fe80:169:254::1", "fd00:1:2:3::5"], ["[2001:db8:2:2:2::2]:10053", "2001:db8:3:3:3::3"], "2001:db8::1"),
])
def test_node_cache_template_custom_upstreams_switch_to_udp(ips, servers, cluster):
    out = fill(NODE_CACHE_TEMPLATE, local_ips=ips, dns_server=None, cluster_domain="cluster.local",
               upstream=" ".join(servers), cluster_dns=cluster)
    tcp = "\n    forward . __PILLAR__UPSTREAM__SERVERS__ {\n            force_tcp\n    }\n"
    expected = (NODE_CACHE_TEMPLATE.replace(tcp, f"\n    forward . {' '.join(servers)}\n")
                .replace("__PILLAR__LOCAL__DNS__", " ".join(ips))
                .replace("__PILLAR__CLUSTER__DNS__", cluster)
                .replace(" __PILLAR__DNS__SERVER__", ""))
    assert out == expected
    # Only the upstream forward loses force_tcp; the cluster forward keeps it.
    assert out.count("force_tcp") == 1 and f"forward . {cluster} {{\n            force_tcp" in out


def test_custom_upstreams_tcp_block_found_whatever_its_indentation():
    text = ".:53 {\n\tforward . __PILLAR__UPSTREAM__SERVERS__ {\n\t\tforce_tcp\n\t}\n}\n"
    out = fill(text, local_ips=["169.254.20.10"], dns_server=None, cluster_domain="cluster.local",
               upstream="8.8.8.8 8.8.4.4", cluster_dns=None)
    assert out == ".:53 {\n\tforward . 8.8.8.8 8.8.4.4\n}\n"


def test_upstream_nodelocal_custom_upstreams():
    # Its .:53 forward has no force_tcp block (already UDP): the servers just go in.
    out = fill(nodelocal(), local_ips=["169.254.20.10"], dns_server="10.96.0.10", cluster_domain="cluster.local",
               upstream="172.16.0.1", cluster_dns="10.96.0.11")
    assert body(out) == UPSTREAM_IPTABLES.replace("forward . /etc/resolv.conf", "forward . 172.16.0.1")


def test_rke2_nodelocal():
    # The chart renders the node's DNS IP itself (the file's <CLUSTER_DNS_IP>) and leaves
    # __PILLAR__CLUSTER__DNS__ and __PILLAR__UPSTREAM__SERVERS__ to node-cache.
    text = (REAL / "rke2-nodelocal.corefile").read_text().replace("<CLUSTER_DNS_IP>", "10.43.0.10")
    assert has_pillars(text)
    out = fill(text, local_ips=["169.254.20.10"], dns_server="10.43.0.10", cluster_domain="cluster.local",
               upstream="/etc/resolv.conf", cluster_dns=None)
    assert not has_pillars(out) and "__PILLAR__" not in body(out)
    lines = body(out).splitlines()
    assert lines.count("    bind 169.254.20.10 10.43.0.10") == 4
    assert lines.count(f"    forward . {IN_PROCESS} {{") == 3
    assert "    forward . /etc/resolv.conf " in lines   # the template's trailing space, kept
    assert "    health 169.254.20.10:8080" in lines
    assert all(bind == ["169.254.20.10", "10.43.0.10"] for _, bind in parses(out))


def test_kubespray_nodelocal_has_nothing_to_fill():
    # Rendered by kubespray with the Service IP and resolv.conf already in place; its header
    # comment says "no __PILLAR__ placeholders", which is no placeholder.
    text = (REAL / "kubespray-nodelocaldns.corefile").read_text()
    assert not has_pillars(text)
    out = fill(text, local_ips=["169.254.25.10"], dns_server=None, cluster_domain="cluster.local",
               upstream="/etc/resolv.conf", cluster_dns=None)
    assert out == text
    lines = body(out).splitlines()
    assert lines.count("    bind 169.254.25.10") == 4 and lines.count("    forward . 10.233.0.3 {") == 3


def test_has_pillars_reads_code_not_comments():
    assert not has_pillars("# bind __PILLAR__LOCAL__DNS__\n.:53 {\n    errors # __PILLAR__DNS__SERVER__\n}\n")
    assert has_pillars('.:53 {\n    forward . "__PILLAR__CLUSTER__DNS__"\n}\n')
    assert has_pillars(".:53 {\n    hosts a#__PILLAR__FOO__\n}\n")    # '#' inside a token is no comment
    assert not has_pillars(".:53 {\n    errors\n}\n")


def test_local_ips_listed_health_gets_the_first():
    out = fill(nodelocal(), local_ips=["169.254.20.10", "10.96.0.10"], dns_server="10.96.0.10",
               cluster_domain="cluster.local", upstream="/etc/resolv.conf", cluster_dns="10.96.0.11")
    lines = body(out).splitlines()
    assert lines.count("    bind 169.254.20.10 10.96.0.10") == 4     # the Service IP once, not twice
    assert "    health 169.254.20.10:8080" in lines
    out6 = fill(nodelocal(), local_ips=["fd00::a", "fd00::b"], dns_server=None, cluster_domain="cluster.local",
                upstream="/etc/resolv.conf", cluster_dns="fd00::10")
    lines6 = body(out6).splitlines()
    assert "    health [fd00::a]:8080" in lines6 and lines6.count("    bind fd00::a fd00::b") == 4
    assert lines6.count("    forward . fd00::10 {") == 3


@pytest.mark.parametrize("kwargs,message", [
    ({"local_ips": ["169.254.20.300"]}, r"local IP '169\.254\.20\.300': not an IP address"),
    ({"local_ips": []}, r"__PILLAR__LOCAL__DNS__: no local IP"),
    ({"dns_server": "kube-dns"}, r"DNS server 'kube-dns': not an IP address"),
    ({"cluster_dns": "10.96.0"}, r"cluster DNS '10\.96\.0': not an IP address"),
    ({"cluster_domain": "cluster_local"}, r"cluster domain 'cluster_local': not a DNS name"),
    ({"upstream": "dns.google"}, r"upstream 'dns\.google': not an IP address"),
    ({"upstream": "8.8.8.8 8.8.4.4:99999"}, r"upstream '8\.8\.4\.4:99999'"),
    ({"upstream": "  "}, r"upstream: empty"),
])
def test_bad_values_are_refused(kwargs, message):
    args = dict(local_ips=["169.254.20.10"], dns_server="10.96.0.10", cluster_domain="cluster.local",
                upstream="/etc/resolv.conf", cluster_dns="10.96.0.11")
    args.update(kwargs)
    with pytest.raises(PillarError, match=message):
        fill(nodelocal(), **args)


def test_unknown_placeholder_names_its_line():
    text = ".:53 {\n    bind __PILLAR__LOCAL__DNS__\n    forward . __PILLAR__KUBE__DNS__\n}\n"
    with pytest.raises(PillarError, match=r"^line 3: unknown placeholder __PILLAR__KUBE__DNS__"):
        fill(text, local_ips=["169.254.20.10"], dns_server=None, cluster_domain="cluster.local",
             upstream="/etc/resolv.conf", cluster_dns=None)


# --- stub domains from the kube-dns ConfigMap ---

def kube_dns(**data: object) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in data.items()}


def test_stub_blocks_node_cache_shape():
    data = kube_dns(stubDomains={"acme.local": ["1.1.1.1"], "widget.local": ["2.2.2.2:10053", "3.3.3.3"]})
    assert stub_blocks(data, ["169.254.20.10", "10.0.0.10"]) == (
        "\n"
        "acme.local:53 {\n"
        "    errors\n"
        "    cache 30\n"
        "    bind 169.254.20.10 10.0.0.10\n"
        "    forward . 1.1.1.1\n"
        "}\n"
        "\n"
        "widget.local:53 {\n"
        "    errors\n"
        "    cache 30\n"
        "    bind 169.254.20.10 10.0.0.10\n"
        "    forward . 2.2.2.2:10053 3.3.3.3\n"
        "}\n")
    six = stub_blocks(kube_dns(stubDomains={"widget.local": ["[2001:db8:2:2:2::2]:10053", "2001:db8:3:3:3::3"]}),
                      ["fe80:169:254::1"], port=1053)
    assert six.splitlines()[1:5] == ["widget.local:1053 {", "    errors", "    cache 30", "    bind fe80:169:254::1"]
    assert "    forward . [2001:db8:2:2:2::2]:10053 2001:db8:3:3:3::3" in six.splitlines()
    assert stub_blocks({}, ["169.254.20.10"]) == ""


@pytest.mark.parametrize("data,message", [
    # kubernetes/dns#539: a name crash-looped node-cache's forward; node-cache now refuses the ConfigMap
    (kube_dns(stubDomains={"google.local": ["google-public-dns-a.google.com"]}),
     r"^stubDomains: 'google\.local': 'google-public-dns-a\.google\.com' is a host name"),
    (kube_dns(stubDomains={"acme.local": []}), r"^stubDomains: 'acme\.local': no nameservers"),
    ({"stubDomains": "{"}, r"^stubDomains: invalid JSON"),
    (kube_dns(stubDomains={"acme.local": ["1.1.1.300"]}), r"invalid nameserver '1\.1\.1\.300'"),
])
def test_stub_blocks_refuse_what_node_cache_refuses(data, message):
    with pytest.raises(KubeDNSError, match=message):
        stub_blocks(data, ["169.254.20.10"])


def test_upstream_from_kube_dns():
    assert pillars.upstream_from_kube_dns({}) == "/etc/resolv.conf"
    assert pillars.upstream_from_kube_dns(kube_dns(upstreamNameservers=["8.8.8.8", "[2003::1]:53"])) \
        == "8.8.8.8 [2003::1]:53"
    with pytest.raises(KubeDNSError, match=r"^upstreamNameservers: 'ns\.foo\.com' is a host name"):
        pillars.upstream_from_kube_dns(kube_dns(upstreamNameservers=["ns.foo.com"]))


def test_node_cache_corefile_from_both_configmaps():
    data = kube_dns(stubDomains={"consul.local": ["10.150.0.1"]}, upstreamNameservers=["172.16.0.1"])
    out = node_cache_corefile(NODE_CACHE_TEMPLATE, data, local_ips=["169.254.20.10"], dns_server="10.96.0.10",
                              cluster_domain="cluster.local", cluster_dns="10.96.0.11")
    assert not has_pillars(out)
    assert out.endswith("\n    forward . 172.16.0.1\n    prometheus :9253\n    }\n\n"
                        "consul.local:53 {\n    errors\n    cache 30\n    bind 169.254.20.10\n"
                        "    forward . 10.150.0.1\n}\n")
    assert "    bind 169.254.20.10 10.96.0.10\n" in out and out.count("force_tcp") == 1
    assert parses(out) == [("cluster.local:53", ["169.254.20.10"]), (".:53", ["169.254.20.10", "10.96.0.10"]),
                           ("consul.local:53", ["169.254.20.10"])]
