"""A real Prometheus scrapes real agents; the stock dashboards and alerts must find their series.

Two `clusterdns agent` processes (the demo cluster, and a cluster served by the
fake API server) with a real upstream DNS server and a dead one; Prometheus
(Debian's `prometheus`) on loopback scrapes both as job="kube-dns" and
job="kube-proxy", labelled as deploy/monitoring/servicemonitors.yaml labels
them, and loads deploy/monitoring/rules.yaml. The test sends DNS queries and
API changes (an EndpointSlice update, a new Service, an invalid object,
failed, expired and dropped watches), then evaluates through Prometheus's HTTP
API every expression of tests/prometheus/stock_queries.yaml and of the agent's
Grafana dashboard: none may fail to parse, each must return series (an
alert's expression without its threshold), except the few marked `empty` with
their reason.
"""
from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import pytest
import yaml

from tests.fakeapi import FakeAPIServer, service
from tests.netutil import free_port as _free_port

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
STOCK = Path(__file__).resolve().parent / "prometheus" / "stock_queries.yaml"
DEMO = ROOT / "clusterdns" / "demo" / "cluster.yaml"

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    not (PROMETHEUS and PROMTOOL),
    reason="prometheus/promtool not installed (Debian package `prometheus`; scripts/setup installs it as root)")


_taken: set[int] = set()


def free_port() -> int:
    """A free port not handed out before in this run (nine are picked before any is bound)."""
    while True:
        port = _free_port()
        if port not in _taken:
            _taken.add(port)
            return port


def template(expr: str) -> str:
    """Grafana/jsonnet variables as "All" sets them."""
    expr = re.sub(r'=~\s*"\$\{?\w+\}?"', '=~".*"', expr)
    expr = re.sub(r'(?<![=!~])=\s*"\$\{?\w+\}?"', '=""', expr)
    return expr.replace("$__rate_interval", "1m")


# ---------------------------------------------------------------- the parts

class Upstream:
    """A real DNS server (dnslib's, UDP) on loopback: A 192.0.2.1 under example., SERVFAIL for
    fail.example., NXDOMAIN elsewhere; RA set as recursive resolvers set it."""

    def __init__(self) -> None:
        from dnslib import QTYPE, RCODE, RR, A
        from dnslib.server import BaseResolver, DNSLogger, DNSServer

        class Resolver(BaseResolver):
            def resolve(self, request, handler):
                reply = request.reply(ra=1, aa=0)
                name = str(request.q.qname).lower()
                if name == "fail.example.":
                    reply.header.rcode = RCODE.SERVFAIL
                elif name.endswith("example.") and request.q.qtype == QTYPE.A:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A("192.0.2.1"), ttl=300))
                elif not name.endswith("example."):
                    reply.header.rcode = RCODE.NXDOMAIN
                return reply

        self.port = free_port()
        quiet = DNSLogger(log="-recv,-send,-request,-reply,-truncated,-error,-data")
        self.server = DNSServer(Resolver(), address="127.0.0.1", port=self.port, logger=quiet)
        self.server.start_thread()

    def stop(self) -> None:
        self.server.stop()


class Agent:
    """`clusterdns agent` as a child process on free loopback ports."""

    def __init__(self, name: str, tmp: Path, *args: str) -> None:
        self.name = name
        self.dns, self.metrics, self.proxy, self.health = (free_port() for _ in range(4))
        self.log = open(tmp / f"agent-{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clusterdns", "agent", "--listen", f"127.0.0.1:{self.dns}",
             "--metrics-listen", f"127.0.0.1:{self.metrics}", "--proxy-metrics-listen", f"127.0.0.1:{self.proxy}",
             "--health-listen", f"127.0.0.1:{self.health}", "--lameduck", "0", "--min-sync-period", "0.2",
             "--log-level", "warning", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"agent {self.name} not ready: {Path(self.log.name).read_text()[-2000:]}")

    def ask(self, name: str, qtype: str = "A", tcp: bool = False, **kw) -> dns.message.Message:
        q = dns.message.make_query(name, qtype, **kw)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, "127.0.0.1", port=self.dns, timeout=5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Prometheus:
    def __init__(self, tmp: Path, agents: list[Agent], rules: Path) -> None:
        self.port = free_port()

        def targets(port_of, k8s_app: str, service_name: str) -> list[dict]:
            return [{"targets": [f"127.0.0.1:{port_of(a)}"],
                     # what servicemonitors.yaml gives a target: the Service's k8s-app, the node, and
                     # the namespace/pod/service labels prometheus-operator adds
                     "labels": {"k8s_app": k8s_app, "node": f"node-{a.name}", "namespace": "kube-system",
                                "pod": f"clusterdns-{a.name}", "service": service_name}} for a in agents]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "kube-dns", "static_configs": targets(lambda a: a.metrics, "kube-dns",
                                                                   "clusterdns-dns-metrics")},
                {"job_name": "kube-proxy", "static_configs": targets(lambda a: a.proxy, "kube-proxy",
                                                                     "clusterdns-proxy-metrics")},
            ],
        }
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus never became ready")

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        data = urllib.parse.urlencode(params).encode() if params else None
        try:
            with urllib.request.urlopen(url, data=data, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:    # 400: a parse error, reported in the body
            return json.loads(exc.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def rule_spec(tmp: Path) -> Path:
    """deploy/monitoring/rules.yaml's PrometheusRule spec as a plain Prometheus rule file."""
    spec = yaml.safe_load((MONITORING / "rules.yaml").read_text())["spec"]
    path = tmp / "clusterdns-rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def dead_port() -> int:
    """A loopback port with nothing behind it: queries sent there fail at once (ICMP unreachable)."""
    return free_port()


# ---------------------------------------------------------------- traffic

def dns_traffic(agent: Agent) -> None:
    zone = "testapp-svc.testapp.svc.cluster.local."
    for _ in range(20):
        assert agent.ask(zone).answer
    assert agent.ask(zone, "AAAA").rcode() == dns.rcode.NOERROR
    assert agent.ask("kube-dns.kube-system.svc.cluster.local.", "SRV", tcp=True).answer
    assert agent.ask(zone, want_dnssec=True).answer                        # DO bit
    assert agent.ask("missing.testapp.svc.cluster.local.").rcode() == dns.rcode.NXDOMAIN
    for i in range(12):     # forwarded: the dead upstream fails its share and turns unhealthy
        assert agent.ask(f"host{i}.example.").answer
    for _ in range(3):
        assert agent.ask("host0.example.").answer                          # the cache
    assert agent.ask("host1.example.", tcp=True).answer
    assert agent.ask("fail.example.").rcode() == dns.rcode.SERVFAIL        # the upstream's SERVFAIL
    assert agent.ask("nothing.invalid.").rcode() == dns.rcode.NXDOMAIN
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:            # a question cut short: FORMERR
        s.settimeout(5)
        s.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03www", ("127.0.0.1", agent.dns))
        assert s.recv(512)[3] & 15 == dns.rcode.FORMERR


def api_changes(api: FakeAPIServer) -> None:
    """A change to DNS and the rules (EndpointSlice with a trigger time, a new Service), an
    invalid object, and the API answering 5xx, 4xx and 410 to the agent's next requests."""
    sl = next(s for s in api.objects("endpointslices") if s["metadata"]["name"].startswith("testapp-svc"))
    sl = json.loads(json.dumps(sl))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sl["metadata"].setdefault("annotations", {})["endpoints.kubernetes.io/last-change-trigger-time"] = now
    sl["endpoints"] = sl["endpoints"][:-1]
    api.update(sl)
    api.add(service("testapp", "added-svc", "172.20.99.1"))
    bad = service("testapp", "bad-svc", "172.20.99.2", clusterIP=12345, clusterIPs=[12345])   # invalid by API type
    api.add(bad)
    time.sleep(1.0)                            # let the events arrive before the watches are cut
    api.fail_next("services", 503)
    api.fail_next("endpointslices", 429)
    api.compact("namespaces")
    api.drop_watches()


def collect_failures(prom: Prometheus, entries: list[dict]) -> list[str]:
    failures = []
    for e in entries:
        what = f"{e['where']}: {e['expr']!r}"
        expr = template(e["expr"])
        res = prom.query(expr)
        if res.get("status") != "success":
            failures.append(f"{what} does not evaluate: {res.get('error')}")
            continue
        if "probe" in e:
            res = prom.query(template(e["probe"]))
            if res.get("status") != "success":
                failures.append(f"{what} probe does not evaluate: {res.get('error')}")
                continue
        result = res["data"]["result"]
        if "empty" in e:
            continue
        if not result:
            failures.append(f"{what} returned no series")
        elif "label" in e and not any(e["label"] in r["metric"] for r in result):
            failures.append(f"{what} has no {e['label']} label (a dashboard variable)")
    return failures


def stock_entries() -> list[dict]:
    data = yaml.safe_load(STOCK.read_text())
    out = []
    for q in data["queries"]:
        assert q["source"] in data["sources"], q
        kind = "alert" if "alert" in q else "variable" if "variable" in q else "panel"
        if kind == "alert":
            assert "probe" in q, f"alert {q['alert']} needs a probe (its expression without threshold)"
        out.append({**q, "where": f"{q['source']} {kind} {q.get(kind)!r}"})
    return out


def dashboard_entries() -> list[dict]:
    dash = json.loads((MONITORING / "clusterdns-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append({"expr": t["expr"], "where": f"clusterdns dashboard panel {panel['title']!r}"})
    return out


# ---------------------------------------------------------------- the test

@needs_prometheus
def test_stock_dashboards_and_alerts_find_their_series(tmp_path):
    started = time.monotonic()
    rules = rule_spec(tmp_path)
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    upstream = Upstream()
    dead = dead_port()
    api = FakeAPIServer(gone_as_http=True).start()
    agents: list[Agent] = []
    prom = None
    try:
        api.load_manifest(str(DEMO))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        ups = ("--upstream", f"127.0.0.1:{upstream.port}", "--upstream", f"127.0.0.1:{dead}")
        agents = [Agent("demo", tmp_path, *ups),
                  Agent("kube", tmp_path, "--kubeconfig", kubeconfig, "--dry-run", *ups)]
        prom = Prometheus(tmp_path, agents, rules)
        for a in agents:
            a.wait_ready()
        errors: list[BaseException] = []

        def run(t_fn, *args):
            try:
                t_fn(*args)
            except BaseException as exc:   # reported below, in the test's thread
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(dns_traffic, a)) for a in agents]
        for t in threads:
            t.start()
        api_changes(api)
        for t in threads:
            t.join()
        assert not errors, errors

        entries = stock_entries() + dashboard_entries()
        # rate() needs two scrapes after the traffic; then give stragglers (health checks, re-lists) time.
        time.sleep(3)
        deadline = time.monotonic() + 25
        while True:
            failures = collect_failures(prom, entries)
            if not failures or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not failures, "\n".join(failures)

        # What the traffic and the change did, as a dashboard reader would see it.
        def value(expr: str) -> dict[str, float]:
            res = prom.query(expr)["data"]["result"]
            return {r["metric"].get("node", ""): float(r["value"][1]) for r in res}
        timed = value('sum by (node) (coredns_dns_request_duration_seconds_count{job="kube-dns"})')
        assert timed == value('sum by (node) (coredns_dns_requests_total{job="kube-dns"})')   # every query timed
        assert set(timed) == {"node-demo", "node-kube"} and min(timed.values()) >= 40
        for part in ("kubernetes", "cache", "forward", ""):
            assert min(value(f'sum by (node) (coredns_dns_responses_total{{plugin="{part}"}})').values()) > 0, part
        assert value('sum by (node) (kubeproxy_network_programming_duration_seconds_count)')["node-kube"] >= 1
        assert value('sum by (node) (coredns_kubernetes_dns_programming_duration_seconds_count'
                     '{service_kind="cluster_ip"})')["node-kube"] >= 1
        for code in ("200", "429", "503", "410"):
            assert value(f'sum by (node) (rest_client_requests_total{{code="{code}"}})')["node-kube"] >= 1, code
        assert value('sum by (node) (clusterdns_invalid_objects_total{kind="Service"})')["node-kube"] == 1

        # The per-node rules deploy/ ships load and evaluate without errors.
        groups = prom.api("rules")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        shipped = [r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
        assert set(shipped) <= set(loaded)
        assert all(loaded[n]["health"] == "ok" for n in shipped), {n: loaded[n].get("lastError") for n in shipped}

        # A node whose agent stops: the per-node alert's expression names it, while the stock
        # absent() alerts stay silent because the other node is still up.
        agents[0].stop()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            down = prom.query('up{job=~"kube-dns|coredns"} == 0')["data"]["result"]
            if down:
                break
            time.sleep(0.5)
        assert [r["metric"]["node"] for r in down] == ["node-demo"]
        assert prom.query('absent(up{k8s_app="kube-dns"} == 1)')["data"]["result"] == []
        print(f"real-Prometheus test: {len(entries)} expressions in {time.monotonic() - started:.1f} s")
    finally:
        for a in agents:
            a.stop()
        if prom is not None:
            prom.stop()
        api.close()
        upstream.stop()


def test_monitoring_manifests_select_the_agent_and_its_ports():
    """services.yaml, servicemonitors.yaml and the kube-prometheus-stack values point at the
    DaemonSet's pods and at the ports the shipped configuration serves."""
    def docs(name):
        return [d for d in yaml.safe_load_all((ROOT / "deploy" / name).read_text()) if d]
    ds = next(d for d in docs("daemonset.yaml") if d["kind"] == "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    conf = yaml.safe_load(next(d for d in docs("configmap.yaml"))["data"]["config.yaml"])
    assert conf["metrics-listen"].endswith(f":{ports['metrics']}") and ports["metrics"] == 9153
    assert conf["proxy-metrics-listen"].endswith(f":{ports['proxy-metrics']}") and ports["proxy-metrics"] == 10249
    assert conf["health-listen"].endswith(f":{ports['health']}")

    services = {d["metadata"]["name"]: d for d in docs("monitoring/services.yaml")}
    jobs = {}
    for svc in services.values():
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports
        jobs[svc["metadata"]["labels"]["k8s-app"]] = svc
    assert set(jobs) == {"kube-dns", "kube-proxy"}          # the job names the stock rules expect
    monitored = set()
    for sm in docs("monitoring/servicemonitors.yaml"):
        assert sm["kind"] == "ServiceMonitor" and sm["spec"]["jobLabel"] == "k8s-app"
        monitored.add(sm["spec"]["selector"]["matchLabels"]["k8s-app"])
        svc = jobs[sm["spec"]["selector"]["matchLabels"]["k8s-app"]]
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        assert "k8s-app" in sm["spec"]["targetLabels"]       # coredns-mixin's k8s_app="kube-dns"
    assert monitored == set(jobs)                            # a ServiceMonitor for each job

    values = yaml.safe_load((MONITORING / "kube-prometheus-stack-values.yaml").read_text())
    assert values["coreDns"]["service"]["selector"].items() <= pod_labels.items()
    assert values["kubeProxy"]["service"]["selector"].items() <= pod_labels.items()
    assert values["coreDns"]["service"]["targetPort"] == ports["metrics"]
    assert values["kubeProxy"]["service"]["targetPort"] == ports["proxy-metrics"]

    dash = json.loads((MONITORING / "clusterdns-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["expr"] for p in dash["panels"] for t in p.get("targets", []))


def test_template_substitution():
    assert template('x{job=~"$job",cluster="$cluster"}[$__rate_interval]') == 'x{job=~".*",cluster=""}[1m]'
    assert template('x{a!="$v"}') == 'x{a!="$v"}'
