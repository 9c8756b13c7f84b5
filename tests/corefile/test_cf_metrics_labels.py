"""The coredns_dns_* series of a Corefile labelled as CoreDNS labels them, scraped from the
Corefile's prometheus address of a `clusterdns dns --corefile` process: `zone` is the key of
the server block that took the query (its longest match), `plugin` the plugin that wrote the
reply; a query no block takes counts under zone "dropped"; a block without prometheus is not
counted; coredns_plugin_enabled names each counted block's answering plugins per zone."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]
SVC = "testapp-svc.testapp.svc.cluster.local."


def _corefile(port: int, port2: int, prom: int) -> str:
    return f"""
.:{port} {{
    bind 127.0.0.1
    errors
    prometheus 127.0.0.1:{prom}
    kubernetes cluster.local in-addr.arpa ip6.arpa
    loadbalance
}}
example.org:{port} {{
    bind 127.0.0.1
    prometheus 127.0.0.1:{prom}
    hosts {{
        192.0.2.7 www.example.org
    }}
    template IN TXT example.org {{
        answer "{{{{ .Name }}}} 60 IN TXT hello"
    }}
}}
quiet.test:{port} {{
    bind 127.0.0.1
    whoami
}}
only.test:{port2} {{
    bind 127.0.0.1
    prometheus 127.0.0.1:{prom}
    whoami
}}
"""


def _samples(prom: int) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=3) as r:
        text = r.read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_zone_and_plugin_labels_of_each_server_block(tmp_path):
    port, port2, prom = free_port(), free_port(), free_port()
    path = tmp_path / "Corefile"
    path.write_text(_corefile(port, port2, prom))
    proc = subprocess.Popen([sys.executable, "-m", "clusterdns", "dns", "--corefile", str(path), "--manifest",
                             str(ROOT / "examples" / "demo-cluster.yaml")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server, server2 = f"dns://127.0.0.1:{port}", f"dns://127.0.0.1:{port2}"

    def ask(name: str, qtype: str = "A", to: int = port, tcp: bool = False) -> dns.message.Message:
        q = dns.message.make_query(name, qtype)
        return (dns.query.tcp if tcp else dns.query.udp)(q, "127.0.0.1", port=to, timeout=3)

    try:
        deadline, reply = time.monotonic() + 30, None
        while reply is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            try:
                reply = dns.query.udp(dns.message.make_query(SVC, "A"), "127.0.0.1", port=port, timeout=0.3)
            except Exception:
                time.sleep(0.1)
        while True:          # the metrics listener comes up once DNS answers
            try:
                before = _samples(prom)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        kube_before = _total(before, "coredns_dns_responses_total", server=server, zone=".", plugin="kubernetes")
        # the cluster name, asked until the receive thread answers it from its memo (and whole replies)
        for _ in range(6):
            assert [rd.address for rs in ask(SVC).answer for rd in rs] == ["172.20.36.232"]
        assert ask(SVC, tcp=True).rcode() == dns.rcode.NOERROR
        assert ask("nope.testapp.svc.cluster.local.").rcode() == dns.rcode.NXDOMAIN
        for case in ("www.example.org.", "WWW.Example.ORG."):
            assert [rd.address for rs in ask(case).answer for rd in rs] == ["192.0.2.7"]      # hosts
        assert ask("t.example.org.", "TXT").answer[0][0].strings == (b"hello",)                # template
        assert ask("missing.example.org.").rcode() == dns.rcode.SERVFAIL     # hosts, no fallthrough: no one wrote it
        assert ask("x.quiet.test.").rcode() == dns.rcode.NOERROR             # whoami in a block without prometheus
        assert ask("elsewhere.", to=port2).rcode() == dns.rcode.REFUSED      # no block on that listener takes it
        assert ask("a.only.test.", to=port2).rcode() == dns.rcode.NOERROR
        after = _samples(prom)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out

    def delta(name: str, **labels) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    responses = "coredns_dns_responses_total"
    assert _total(after, responses, server=server, zone=".", plugin="kubernetes") - kube_before == 8
    assert delta(responses, server=server, zone=".", rcode="NXDOMAIN", plugin="kubernetes") == 1
    assert delta(responses, server=server, zone="example.org.", rcode="NOERROR", plugin="hosts") == 2
    assert delta(responses, server=server, zone="example.org.", rcode="NOERROR", plugin="template") == 1
    assert delta(responses, server=server, zone="example.org.", rcode="SERVFAIL", plugin="") == 1
    assert delta(responses, server=server2, zone="dropped", rcode="REFUSED", plugin="") == 1
    assert delta(responses, server=server2, zone="only.test.", rcode="NOERROR", plugin="whoami") == 1
    zones = {s.labels["zone"] for s in after if s.name.startswith("coredns_dns_") and "zone" in s.labels}
    assert "quiet.test." not in zones and {".", "example.org.", "only.test.", "dropped"} <= zones
    # every series of a query carries its zone: requests, durations and sizes agree per zone
    for zone, n in ((".", 8), ("example.org.", 4)):
        assert delta("coredns_dns_requests_total", server=server, zone=zone) == n
    assert delta("coredns_dns_requests_total", server=server, zone=".", proto="tcp", type="A") == 1
    assert delta("coredns_dns_request_duration_seconds_count", server=server, zone="example.org.") == 4
    assert delta("coredns_dns_request_duration_seconds_count", server=server, zone="example.org.", type="TXT") == 1
    assert delta("coredns_dns_request_size_bytes_count", server=server, zone="example.org.", proto="udp") == 4
    assert delta("coredns_dns_response_size_bytes_count", server=server2, zone="dropped", proto="udp") == 1
    enabled = {(s.labels["server"], s.labels["zone"], s.labels["name"]) for s in after
               if s.name == "coredns_plugin_enabled" and s.value == 1}
    assert {n for srv, z, n in enabled if (srv, z) == (server, ".")} == {"errors", "prometheus", "kubernetes",
                                                                         "loadbalance"}
    assert {n for srv, z, n in enabled if (srv, z) == (server, "example.org.")} == {"prometheus", "template",
                                                                                    "hosts"}
    assert {n for srv, z, n in enabled if (srv, z) == (server2, "only.test.")} == {"prometheus", "whoami"}
    assert not [e for e in enabled if e[1] == "quiet.test."]


NODE_LOCAL = """cluster.local:{PORT} {
    errors
    cache {
            success 9984 30
            denial 9984 5
    }
    bind 127.0.0.1
    forward . clusterdns:state {
            force_tcp
    }
    prometheus 127.0.0.1:9253
    }
"""
CLUSTER = """.:53 {
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa
    prometheus :9153
    loadbalance
}
"""


@pytest.mark.parametrize("hop", [False, True])
async def test_node_local_forward_answered_in_process_is_labelled_forward(tmp_path, hop):
    """node-local-dns's forward to the cluster DNS, answered in this process (the flags' cluster
    DNS, or --cluster-corefile's), is labelled as node-cache labels it: its forward wrote the
    reply, in its block's zone; kubernetes is not among its plugins."""
    from prometheus_client import generate_latest

    from clusterdns.metrics import DNS as REGISTRY
    from tests.corefile.cfserve import CorefileServer

    options = {}
    if hop:
        cluster = tmp_path / "coredns.Corefile"
        cluster.write_text(CLUSTER)
        options["cluster_corefile"] = str(cluster)

    def samples():
        text = generate_latest(REGISTRY).decode()
        return [s for f in text_string_to_metric_families(text) for s in f.samples]

    async with CorefileServer(NODE_LOCAL, tmp_path, **options) as s:
        server = f"dns://127.0.0.1:{s.port}"
        before = samples()
        for _ in range(5):
            r = await s.ask(SVC, "A")
            assert [rd.address for rs in r.answer for rd in rs] == ["172.20.36.232"]
        assert (await s.ask("nope.testapp.svc.cluster.local.", "A", tcp=True)).rcode() == dns.rcode.NXDOMAIN
        after = samples()
    got = {(s.labels["rcode"], s.labels["plugin"]): s.value - _total(before, s.name, **s.labels)
           for s in after if s.name == "coredns_dns_responses_total" and s.labels["server"] == server}
    assert {k: v for k, v in got.items() if v} == {("NOERROR", "forward"): 5, ("NXDOMAIN", "forward"): 1}
    assert {s.labels["zone"] for s in after if s.name == "coredns_dns_requests_total"
            and s.labels["server"] == server} == {"cluster.local."}
    enabled = {s.labels["name"] for s in after if s.name == "coredns_plugin_enabled" and s.labels["server"] == server}
    assert enabled == {"errors", "cache", "forward", "prometheus"}
