from clusterdns.dns.resolvconf import ResolvConf, candidates, parse, read

POD = """# written by kubelet
search testapp.svc.cluster.local svc.cluster.local cluster.local
nameserver 172.20.0.10
options ndots:5
"""


def test_parse_pod_resolv_conf():
    conf = parse(POD)
    assert conf.nameservers == ("172.20.0.10",)
    assert conf.search == ("testapp.svc.cluster.local", "svc.cluster.local", "cluster.local")
    assert conf.ndots == 5
    assert conf.timeout == 5 and conf.attempts == 2 and not conf.rotate
    assert conf.warnings == ()


def test_parse_options_comments_and_overrides():
    conf = parse("""
nameserver 10.0.0.1   # primary
nameserver 2001:db8::1 ; secondary
; a comment line
domain example.org
search a.example. b.example
options ndots:20 timeout:0 attempts:9 rotate edns0 ndots:x
frobnicate yes
nameserver
""")
    assert conf.nameservers == ("10.0.0.1", "2001:db8::1")
    assert conf.search == ("a.example", "b.example")   # search after domain wins
    assert conf.ndots == 15 and conf.timeout == 1 and conf.attempts == 5  # clamped like glibc
    assert conf.rotate
    assert "edns0" in conf.options
    assert any("ndots:x" in w for w in conf.warnings)
    assert any("frobnicate" in w for w in conf.warnings)
    assert any("nameserver without" in w for w in conf.warnings)
    assert parse("search a b\ndomain c\n").search == ("c",)


def test_candidates_short_name_walks_search_list_first():
    conf = parse(POD)
    assert candidates("testapp-svc", conf) == [
        "testapp-svc.testapp.svc.cluster.local.",
        "testapp-svc.svc.cluster.local.",
        "testapp-svc.cluster.local.",
        "testapp-svc.",
    ]
    assert candidates("testapp-svc.testapp", conf)[1] == "testapp-svc.testapp.svc.cluster.local."


def test_candidates_many_dots_tried_as_is_first():
    conf = parse(POD)
    assert candidates("a.b.c.d.example.com", conf)[0] == "a.b.c.d.example.com."
    assert candidates("a.b.c.d.example.com", conf)[1] == "a.b.c.d.example.com.testapp.svc.cluster.local."
    assert candidates("www.example.com", ResolvConf(search=("corp",), ndots=1)) == [
        "www.example.com.", "www.example.com.corp."]


def test_candidates_absolute_name_and_empty_search():
    conf = parse(POD)
    assert candidates("testapp-svc.testapp.svc.cluster.local.", conf) == [
        "testapp-svc.testapp.svc.cluster.local."]
    assert candidates("host", ResolvConf()) == ["host."]
    assert candidates("", conf) == ["."]


def test_read_file(tmp_path):
    p = tmp_path / "resolv.conf"
    p.write_text(POD)
    assert read(str(p)).ndots == 5
