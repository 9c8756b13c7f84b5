"""Cluster DNS names: grammar, endpoint and pod labels, reverse names, label selectors."""
from __future__ import annotations

import pytest

from clusterdns.config import ConfigError
from clusterdns.dns import names
from clusterdns.dns.names import Parsed

ZONES = sorted([names.split_name(z) for z in ("cluster.local", "in-addr.arpa", "ip6.arpa", "corp.cluster.local")],
               key=len, reverse=True)


@pytest.mark.parametrize("rest,expected", [
    ("", Parsed("apex")),
    ("dns-version", Parsed("version")),
    ("ns.dns", Parsed("nsname")),
    ("dns", Parsed("dnsent")),
    ("svc", Parsed("ent")),
    ("pod", Parsed("ent")),
    ("testapp.svc", Parsed("namespace", "testapp")),
    ("web.testapp.svc", Parsed("service", "testapp", "web")),
    ("web-0.web.testapp.svc", Parsed("endpoint", "testapp", "web", "web-0")),
    ("_http._tcp.web.testapp.svc", Parsed("port", "testapp", "web", port="http", proto="tcp")),
    ("http.tcp.web.testapp.svc", Parsed("port", "testapp", "web", port="http", proto="tcp")),
    ("_._tcp.web.testapp.svc", names.NX),
    ("a._http._tcp.web.testapp.svc", names.NX),
    ("testapp.pod", Parsed("podns", "testapp")),
    ("10-1-2-3.testapp.pod", Parsed("pod", "testapp", endpoint="10-1-2-3")),
    ("x.10-1-2-3.testapp.pod", names.NX),
    ("web.testapp", names.NX),
    ("foo", names.NX),
    ("*.testapp.svc", Parsed("service", "testapp", "*")),   # wildcards are literal labels
])
def test_parse(rest, expected):
    assert names.parse(names.split_name(rest)) == expected


def test_zone_of_prefers_the_longest_zone():
    assert names.zone_of(names.split_name("a.b.corp.cluster.local"), ZONES) == ("corp", "cluster", "local")
    assert names.zone_of(names.split_name("a.svc.cluster.local"), ZONES) == ("cluster", "local")
    assert names.zone_of(names.split_name("cluster.local"), ZONES) == ("cluster", "local")
    assert names.zone_of(names.split_name("example.com"), ZONES) is None
    assert names.zone_of(names.split_name("xcluster.local"), ZONES) is None


@pytest.mark.parametrize("hostname,pod,ip,pod_names,expected", [
    ("web-0", "web-0-pod", "10.0.0.1", True, "web-0"),
    ("", "web-0-pod", "10.0.0.1", True, "web-0-pod"),
    ("", "web-0-pod", "10.0.0.1", False, "10-0-0-1"),
    ("", "p" * 64, "10.0.0.1", True, "10-0-0-1"),
    ("", "", "2001:db8::", False, "2001-db8--0"),
    ("", "", "fd00:161::2", False, "fd00-161--2"),
    ("", "", "::1", False, "--1"),
])
def test_endpoint_name(hostname, pod, ip, pod_names, expected):
    assert names.endpoint_name(hostname, pod, ip, pod_names) == expected


@pytest.mark.parametrize("label,expected", [
    ("10-161-37-5", "10.161.37.5"),
    ("fd00-161--2", "fd00:161::2"),
    ("2001-db8--0", "2001:db8::"),
    ("10-161-37", None),
    ("010-1-2-3", None),
    ("300-1-2-3", None),
    ("web-0", None),
    ("a-b-c-d", None),
])
def test_pod_label_ip(label, expected):
    assert names.pod_label_ip(label) == expected


@pytest.mark.parametrize("name,expected", [
    ("232.36.20.172.in-addr.arpa", "172.20.36.232"),
    ("36.20.172.in-addr.arpa", None),
    ("1.2.3.256.in-addr.arpa", None),
    ("01.2.3.4.in-addr.arpa", None),
    ("5.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.2.0.0.0.0.d.f.ip6.arpa", "fd00:20::5"),
    ("5.0.0.ip6.arpa", None),
    ("g.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.2.0.0.0.0.d.f.ip6.arpa", None),
])
def test_reverse_ip(name, expected):
    assert names.reverse_ip(names.split_name(name)) == expected


def test_reverse_name_round_trip():
    for ip in ("10.0.0.1", "fd00:20::5"):
        assert names.reverse_ip(names.reverse_name(ip)) == ip


@pytest.mark.parametrize("selector,labels,expected", [
    ("team=a", {"team": "a"}, True),
    ("team=a", {"team": "b"}, False),
    ("team==a", {"team": "a"}, True),
    ("team!=a", {}, True),
    ("team!=a", {"team": "a"}, False),
    ("team", {"team": ""}, True),
    ("team", {}, False),
    ("!team", {}, True),
    ("!team", {"team": "x"}, False),
    ("env in (prod, staging)", {"env": "staging"}, True),
    ("env in (prod,staging)", {"env": "dev"}, False),
    ("env notin (prod)", {"env": "dev"}, True),
    ("env notin (prod)", {}, True),
    ("env notin (prod)", {"env": "prod"}, False),
    ("env in (prod,staging),team=a", {"env": "prod", "team": "a"}, True),
    ("env in (prod,staging),team=a", {"env": "prod", "team": "b"}, False),
    ("kubernetes.io/metadata.name=testapp", {"kubernetes.io/metadata.name": "testapp"}, True),
    ("", {"x": "y"}, True),
])
def test_selector(selector, labels, expected):
    assert names.parse_selector(selector)(labels) is expected


@pytest.mark.parametrize("bad", ["env in ()", "env in (a", "a=b)", "=a", "a b", "env in prod", "a=b=c"])
def test_selector_errors_are_config_errors(bad):
    with pytest.raises(ConfigError):
        names.parse_selector(bad)
