"""`clusterdns trace`: the resolver walk, the rule path and the endpoints, on the demo cluster."""
import asyncio
import json

import pytest

from clusterdns import cli, trace
from clusterdns.config import load
from clusterdns.dns.resolvconf import parse
from clusterdns.proxy import names
from clusterdns.sources.loader import load_once

SVC = "testapp-svc.testapp.svc.cluster.local."


def run_trace(capsys, *args):
    code = cli.main(["trace", *args, "--no-upstream"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_walk_stops_at_the_service_with_the_rule_path(capsys):
    code, out, _ = run_trace(capsys, "testapp-svc", "--from-pod", "testapp/client")
    assert code == 0
    assert "search testapp.svc.cluster.local svc.cluster.local cluster.local" in out
    assert "ndots:5" in out and "nameserver 172.20.0.10" in out
    assert f"stops at {SVC} -> 172.20.36.232" in out
    chain = names.svc_chain("testapp/testapp-svc", "tcp")
    assert f"KUBE-SERVICES -> {chain} -> one of 74:" in out
    assert "p=0.0135135135" in out and "-> 10.161.33.100:8080" in out
    assert "Endpoints (74 ready of 74)" in out
    assert "\033[" not in out          # no colour when stdout is not a terminal


def test_json_schema(capsys):
    code, out, _ = run_trace(capsys, "testapp-svc", "--from-pod", "testapp/client", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "clusterdns.trace/v1"
    assert set(data) >= {"name", "resolver", "server", "walk", "service", "rules", "endpoints"}
    r = data["resolver"]
    assert r["pod"] == "testapp/client" and r["client_ip"] == "10.161.37.5"
    assert r["search"] == ["testapp.svc.cluster.local", "svc.cluster.local", "cluster.local"]
    assert r["ndots"] == 5 and r["nameservers"] == ["172.20.0.10"]
    w = data["walk"]
    assert w["outcome"] == "answer" and w["stopped_at"] == SVC and w["addresses"] == ["172.20.36.232"]
    assert [(q["name"], q["type"]) for q in w["queries"]] == [(SVC, "A"), (SVC, "AAAA")]
    a, aaaa = w["queries"]
    assert a["rcode"] == "NOERROR" and a["aa"] and a["answers"][0]["data"] == "172.20.36.232"
    assert aaaa["rcode"] == "NOERROR" and aaaa["answers"] == []     # NODATA, not NXDOMAIN
    assert data["service"]["cluster_ips"] == ["172.20.36.232"]
    assert data["service"]["ports"][0]["port"] == 8080
    rules = data["rules"]
    assert rules["mode"] == "iptables" and rules["family"] == 4
    port = rules["ports"][0]
    assert port["cluster_ip"] == "172.20.36.232" and port["port_number"] == 8080
    assert len(port["dispatch"]) == 74 and port["endpoints_used"] == 74
    first, last = port["dispatch"][0], port["dispatch"][-1]
    assert first["probability"] == pytest.approx(0.0135135135) and first["probability_text"] == "0.0135135135"
    assert last["probability"] == 1.0 and last["probability_text"] is None
    assert first["chain"] == names.svc_chain("testapp/testapp-svc", "tcp")
    assert first["target"] == names.sep_chain("testapp/testapp-svc", "tcp", "10.161.33.100:8080")
    assert {d["endpoint"] for d in port["dispatch"]} == {f"10.161.33.{i}:8080" for i in range(100, 174)}
    assert len(data["endpoints"]) == 74
    ep = data["endpoints"][0]
    assert set(ep) >= {"address", "ready", "node", "zone", "pod"}
    assert ep["ready"] is True and ep["node"] in ("node-a", "node-b")


def test_nxdomain_walks_the_whole_search_list(capsys):
    code, out, _ = run_trace(capsys, "nosuch", "--from-pod", "testapp/client", "--json")
    assert code == 1
    w = json.loads(out)["walk"]
    order = [q["name"] for q in w["queries"] if q["type"] == "A"]
    assert order == ["nosuch.testapp.svc.cluster.local.", "nosuch.svc.cluster.local.",
                     "nosuch.cluster.local.", "nosuch."]
    assert [q["type"] for q in w["queries"]] == ["A", "AAAA"] * 4
    assert all(q["rcode"] == "NXDOMAIN" for q in w["queries"][:6])
    assert w["outcome"] != "answer" and w["addresses"] == []
    code, text, _ = run_trace(capsys, "nosuch", "--from-pod", "testapp/client")
    assert "nosuch.cluster.local." in text and "Rules" not in text


def test_resolv_conf_file_and_ndots(tmp_path, capsys):
    conf = tmp_path / "resolv.conf"
    conf.write_text("search testapp.svc.cluster.local svc.cluster.local cluster.local\n"
                    "nameserver 172.20.0.10\noptions ndots:1\n")
    code, out, _ = run_trace(capsys, "testapp-svc.testapp", "--resolv-conf", str(conf), "--json")
    data = json.loads(out)
    names_tried = [q["name"] for q in data["walk"]["queries"] if q["type"] == "A"]
    # one dot >= ndots:1: tried as written first (REFUSED here: no upstream), then the search list
    assert names_tried[0] == "testapp-svc.testapp."
    assert names_tried[1] == "testapp-svc.testapp.testapp.svc.cluster.local."
    assert data["walk"]["stopped_at"] == "testapp-svc.testapp.svc.cluster.local."
    assert data["resolver"]["source"] == "file" and code == 0


def test_headless_and_external_name_have_no_rules(capsys):
    code, out, _ = run_trace(capsys, "external-db", "--from-pod", "testapp/client", "--json")
    data = json.loads(out)
    assert data["walk"]["queries"][0]["answers"][0]["type"] == "CNAME"
    assert data["rules"]["ports"] == [] and "ExternalName" in data["rules"]["note"]

    code, out, _ = run_trace(capsys, "testapp-headless", "--from-pod", "testapp/client", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["service"]["name"] == "testapp-headless" and data["service"]["headless"] is True
    # DNS answers the endpoint addresses themselves, not a ClusterIP
    endpoints = {e["address"] for e in data["endpoints"] if e["ready"]}
    assert endpoints and set(data["walk"]["addresses"]) == endpoints
    assert data["rules"]["ports"] == [] and data["rules"]["note"].startswith("headless")


def test_bad_input_is_exit_2(capsys, tmp_path):
    code, _, err = run_trace(capsys, "testapp-svc", "--from-pod", "testapp/nobody")
    assert code == 2 and "pod testapp/nobody not found" in err
    code, _, err = run_trace(capsys, "x", "--resolv-conf", str(tmp_path / "missing"))
    assert code == 2 and "missing" in err
    code, _, err = run_trace(capsys, "x", "--from-pod", "nopod")
    assert code == 2 and "NAMESPACE/POD" in err


def test_walk_over_the_wire_against_a_running_server():
    """The same walk through a real DnsService socket (what --listen HOST:PORT does)."""
    from clusterdns.dns.server import DnsService
    from clusterdns.sources.manifest import DEMO_MANIFEST, load_files, publish
    from clusterdns.state import StateStore

    async def main():
        cfg = load(["dns", "--listen", "127.0.0.1:0", "--no-upstream", "--manifest", DEMO_MANIFEST])
        store = StateStore()
        publish(store, load_files([DEMO_MANIFEST])[0])
        service = DnsService(cfg, store)
        await service.start()
        try:
            host, port = service.bound[0]
            tcfg = load(["trace", "testapp-svc", "--from-pod", "testapp/client", "--no-upstream",
                         "--listen", f"{host}:{port}"])
            asker = trace.make_asker(tcfg, store.current, {}, parse(""))
            assert isinstance(asker, trace.WireAsker)
            data = await trace.build_trace(tcfg, store.current, asker)
        finally:
            await service.stop()
        return data

    data = asyncio.run(main())
    assert data["server"].startswith("127.0.0.1:")
    assert data["walk"]["addresses"] == ["172.20.36.232"]
    assert data["rules"]["ports"][0]["dispatch"][0]["probability_text"] == "0.0135135135"


def test_text_table_alignment_and_colour():
    cfg = load(["trace", "testapp-svc", "--from-pod", "testapp/client", "--no-upstream"])
    data = asyncio.run(trace.build_trace(cfg, load_once(cfg)))
    coloured = trace.format_text(data, color=True)
    assert "\033[32m" in coloured
    plain = trace.format_text(data)
    rows = [line for line in plain.splitlines() if line.startswith("  1  ")]
    assert len(rows) == 2 and rows[0].index(" A ") == rows[1].index(" AAAA")


def test_nftables_rule_path(capsys):
    code, out, _ = run_trace(capsys, "testapp-svc", "--from-pod", "testapp/client", "--json",
                             "--proxy-mode", "nftables", "--cluster-cidr", "10.161.0.0/16")
    assert code == 0
    rules = json.loads(out)["rules"]
    assert rules["mode"] == "nftables"
    port = rules["ports"][0]
    base = names.nft_service_base("testapp", "testapp-svc", "tcp", "")
    assert any("service-ips" in e and "172.20.36.232 . tcp . 8080" in e and f"service-{base}" in e
               for e in port["entry"])
    # the 74 endpoints split the Service's 65536 numbers as evenly as integers allow
    assert len(port["dispatch"]) == 74 and port["dispatch"][0]["probability_text"] in ("885/65536", "886/65536")
    assert sum(int(d["probability_text"].split("/")[0]) for d in port["dispatch"]) == 65536
    assert port["dispatch"][0]["endpoint"] == "10.161.33.100:8080"
    assert any(m["when"].startswith("hairpin") for m in port["masquerade"])
    assert any("10.161.0.0/16" in m["when"] for m in port["masquerade"])


def test_trace_against_a_live_cluster(tmp_path, capsys):
    """--kubeconfig: the state comes from the API server (the fake one, real protocol)."""
    from clusterdns.sources.manifest import DEMO_MANIFEST
    from tests.fakeapi import FakeAPIServer
    with FakeAPIServer() as api:
        api.load_manifest(DEMO_MANIFEST)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        code, out, err = run_trace(capsys, "testapp-svc", "--from-pod", "testapp/client",
                                   "--kubeconfig", kubeconfig, "--pods", "verified", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["walk"]["addresses"] == ["172.20.36.232"]
    assert data["resolver"]["client_ip"] == "10.161.37.5"
    assert len(data["rules"]["ports"][0]["dispatch"]) == 74


def _ipvsadm_reals(text: str, key: str) -> set[str]:
    """Real servers of one virtual server, read from ipvsadm-restore input."""
    return {line.split(" -r ")[1].split()[0] for line in text.splitlines() if line.startswith(f"-a {key} -r ")}


def test_ipvs_rule_path_is_the_ipvs_one(capsys):
    from clusterdns.proxy import ipvs
    code, out, _ = run_trace(capsys, "testapp-svc", "--json", "--proxy-mode", "ipvs")
    assert code == 0
    rules = json.loads(out)["rules"]
    assert rules["mode"] == "ipvs"
    port = rules["ports"][0]
    # no nftables objects or iptables service chains under the ipvs label
    text = json.dumps(port)
    assert "service-ips" not in text and "KUBE-SVC-" not in text and "numgen" not in text
    vs = {v["key"]: v for v in port["virtual_servers"]}
    assert set(vs) == {"-t 172.20.36.232:8080"}
    cfg = load(["rules", "--mode", "ipvs"])
    conf = ipvs.render(load_once(cfg), cfg, 4)
    reals = {f"{r['address']}:{r['port']}" for r in vs["-t 172.20.36.232:8080"]["real_servers"]}
    assert reals == _ipvsadm_reals(conf.ipvsadm, "-t 172.20.36.232:8080")
    assert reals == {f"10.161.33.{i}:8080" for i in range(100, 174)}
    assert vs["-t 172.20.36.232:8080"]["scheduler"] == "rr"
    assert {d["endpoint"] for d in port["dispatch"]} == reals and port["dispatch"][0]["probability_text"] == "1/74 (rr)"
    assert port["ipsets"]["KUBE-CLUSTER-IP"] == ["172.20.36.232,tcp:8080"]
    assert port["ipsets"]["KUBE-IPVS-IPS"] == ["172.20.36.232"]
    # node-a's endpoints are in the hairpin set, node-b's are not
    loop = set(port["ipsets"]["KUBE-LOOP-BACK"])
    assert "10.161.33.100,tcp:8080,10.161.33.100" in loop and not any(e.startswith("10.161.33.101,") for e in loop)
    rule_lines = [r for c in port["chains"] for r in c["rules"]]
    assert all(r in conf.iptables.splitlines() for r in rule_lines)
    assert any("--match-set KUBE-CLUSTER-IP dst,dst ! -s 10.161.0.0/16 -j KUBE-MARK-MASQ" in r for r in rule_lines)
    assert any("KUBE-IPVS-FILTER" in r and "KUBE-CLUSTER-IP" in r for r in rule_lines)
    whens = {m["when"] for m in port["masquerade"]}
    assert "source outside the cluster CIDR 10.161.0.0/16" in whens and any(w.startswith("hairpin") for w in whens)
    assert port["cluster_masquerade"] is True


def test_ipvs_nodeport_virtual_servers_and_text(capsys):
    code, out, _ = run_trace(capsys, "testapp2-svc", "--json", "--proxy-mode", "ipvs")
    assert code == 0
    port = json.loads(out)["rules"]["ports"][0]
    keys = {v["key"] for v in port["virtual_servers"]}
    cluster_ip = json.loads(out)["service"]["cluster_ips"][0]
    assert "-t 192.168.49.2:31218" in keys and any(k.startswith(f"-t {cluster_ip}:") for k in keys)
    assert port["ipsets"]["KUBE-NODE-PORT-TCP"] == ["31218"]
    assert any("KUBE-NODE-PORT-TCP" in r and r.endswith("-j KUBE-MARK-MASQ") for c in port["chains"] for r in c["rules"])
    code, text, _ = run_trace(capsys, "testapp2-svc", "--proxy-mode", "ipvs")
    assert "Rules (ipvs, IPv4)" in text and "virtual server -t 192.168.49.2:31218" in text
    assert f"virtual server -t {cluster_ip}:" in text and "service-ips map" not in text


def test_demo_default_is_the_design_path(capsys):
    """No --from-pod or --resolv-conf on the demo cluster: the pod testapp/client."""
    code, out, _ = run_trace(capsys, "testapp-svc", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["resolver"]["pod"] == "testapp/client" and data["resolver"]["client_ip"] == "10.161.37.5"
    assert data["walk"]["addresses"] == ["172.20.36.232"]
    code, text, _ = run_trace(capsys, "testapp-svc")
    assert "from pod testapp/client" in text and f"stops at {SVC}" in text


def test_upstream_candidates_are_named_and_logs_stay_out(capsys):
    """The last candidate goes to the upstream (here nothing listens there): the output says
    so, and the forwarder's warning comes after the trace on stderr, not inside it."""
    from tests.netutil import free_port
    port = free_port()
    code = cli.main(["trace", "nosuch", "--upstream", f"127.0.0.1:{port}", "--json"])
    out = capsys.readouterr()
    data = json.loads(out.out)     # stdout is nothing but the trace
    assert code == 1
    routes = {(q["name"], q["route"]) for q in data["walk"]["queries"]}
    assert routes == {("nosuch.testapp.svc.cluster.local.", "zone"), ("nosuch.svc.cluster.local.", "zone"),
                      ("nosuch.cluster.local.", "zone"), ("nosuch.", "upstream")}
    assert data["walk"]["upstream"] == ["nosuch."]
    assert any("unhealthy" in line for line in data["log"]), data["log"]
    cli.main(["trace", "nosuch", "--upstream", f"127.0.0.1:{port}"])
    out = capsys.readouterr()
    assert "sent upstream (outside the served zones): nosuch." in out.out
    assert "WARNING" not in out.out and "unhealthy" in out.err


def test_no_upstream_candidates_are_refused_not_forwarded(capsys):
    code, out, _ = run_trace(capsys, "nosuch", "--json")
    assert code == 1
    w = json.loads(out)["walk"]
    assert [q["route"] for q in w["queries"] if q["name"] == "nosuch."] == ["refused", "refused"]
    assert w["upstream"] == []


def test_ipvs_load_balancer_with_source_ranges_and_local_policy(capsys):
    code, out, _ = run_trace(capsys, "testapp-lb", "--json", "--proxy-mode", "ipvs")
    assert code == 0
    port = json.loads(out)["rules"]["ports"][0]
    assert port["ipsets"]["KUBE-LOAD-BALANCER-SOURCE-CIDR"] == ["203.0.113.10,tcp:80,198.51.100.0/24"]
    assert port["ipsets"]["KUBE-LOAD-BALANCER-LOCAL"] == ["203.0.113.10,tcp:80"]
    rules = {r for c in port["chains"] for r in c["rules"]}
    assert "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP" in rules        # sources outside the ranges
    # externalTrafficPolicy Local: RETURN before masquerade for LoadBalancer and NodePort traffic
    assert {m["chain"] for m in port["masquerade"]} == {"KUBE-SERVICES", "KUBE-POSTROUTING"}
