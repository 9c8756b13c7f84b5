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
    from clusterdns.state import StateStore
    from clusterdns.sources.manifest import publish, load_files, DEMO_MANIFEST

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
    rules = json.loads(out)["rules"]
    assert rules["mode"] == "nftables"
    port = rules["ports"][0]
    base = names.nft_service_base("testapp", "testapp-svc", "tcp", "")
    assert any("service-ips" in e and "172.20.36.232 . tcp . 8080" in e and f"service-{base}" in e
               for e in port["entry"])
    assert len(port["dispatch"]) == 74 and port["dispatch"][0]["probability_text"] == "1/74"
    assert port["dispatch"][0]["endpoint"] == "10.161.33.100:8080"
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
