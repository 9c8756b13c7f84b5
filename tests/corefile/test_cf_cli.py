"""The commands as a user runs them with --corefile: `dns` serving a Corefile (health, ready
and metrics on the Corefile's addresses), `config check`, `trace`, and exit 2 with FILE:LINE."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import dns.message
import dns.query
import dns.rcode

from tests.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterdns", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _corefile(tmp_path: Path, dns_port: int, health: int, ready: int, prom: int) -> Path:
    path = tmp_path / "Corefile"
    # written in an order unlike CoreDNS's: config check must print the run order
    path.write_text(f"""# a kubeadm-like block on loopback ports
.:{dns_port} {{
    loop
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    prometheus 127.0.0.1:{prom}
    ready 127.0.0.1:{ready}
    health 127.0.0.1:{health} {{
       lameduck 1s
    }}
    bind 127.0.0.1
    reload
}}
""")
    return path


def test_config_check_prints_blocks_and_plugins_in_run_order(tmp_path):
    path = _corefile(tmp_path, 5301, 5302, 5303, 5304)
    r = _run("config", "check", "--corefile", str(path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"Corefile {path}"
    assert lines[1] == f"server block {path}:2: zones . on 127.0.0.1:5301"
    order = [ln.split(". ", 1)[1].split()[0] for ln in lines if ln.startswith("  ") and ". " in ln]
    assert order == ["reload", "bind", "ready", "health", "prometheus", "kubernetes", "loop"]
    assert "ttl 30" in r.stdout and "lameduck 1s" in r.stdout
    assert lines[-1].startswith("process: health 127.0.0.1:5302, ready 127.0.0.1:5303, metrics 127.0.0.1:5304")


def test_bad_corefile_exits_2_with_file_and_line(tmp_path):
    path = tmp_path / "Corefile"
    path.write_text(".:53 {\n    kubernetes cluster.local {\n        pods always\n    }\n}\n")
    for cmd in (["config", "check"], ["dns", "--manifest", str(ROOT / "examples" / "demo-cluster.yaml")]):
        r = _run(*cmd, "--corefile", str(path))
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines()[-1].startswith(f"clusterdns: {path}:3: plugin/kubernetes: pods")
    r = _run("config", "check", "--corefile", str(tmp_path / "missing"))
    assert r.returncode == 2 and "missing" in r.stderr
    r = _run("dns", "--corefile", str(path), "--upstream", "1.1.1.1")
    assert r.returncode == 2 and "--upstream: with --corefile the Corefile says this (forward)" in r.stderr


def test_dns_serves_the_corefile_with_its_health_ready_and_metrics(tmp_path):
    dns_port, health, ready, prom = (free_port() for _ in range(4))
    path = _corefile(tmp_path, dns_port, health, ready, prom)
    proc = subprocess.Popen([sys.executable, "-m", "clusterdns", "dns", "--corefile", str(path), "--manifest",
                             str(ROOT / "examples" / "demo-cluster.yaml")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        q = dns.message.make_query("testapp-svc.testapp.svc.cluster.local", "A")
        deadline, reply = time.monotonic() + 20, None
        while time.monotonic() < deadline and reply is None:
            assert proc.poll() is None, proc.stdout.read()
            try:
                reply = dns.query.udp(q, "127.0.0.1", port=dns_port, timeout=0.3)
            except Exception:
                time.sleep(0.1)
        assert reply is not None and reply.rcode() == dns.rcode.NOERROR
        assert [rd.to_text() for rs in reply.answer for rd in rs] == ["172.20.36.232"] and reply.answer[0].ttl == 30
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if _get(health, "/health")[0] == 200 and _get(ready, "/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        assert _get(health, "/health") == (200, "OK")
        assert _get(ready, "/ready") == (200, "OK")
        status, text = _get(prom, "/metrics")
        assert status == 200
        served = [ln for ln in text.splitlines()
                  if ln.startswith("coredns_dns_requests_total") and f'server="dns://127.0.0.1:{dns_port}"' in ln]
        assert served, "the Corefile's listener is counted"
        enabled = {ln.split('name="')[1].split('"')[0] for ln in text.splitlines()
                   if ln.startswith("coredns_plugin_enabled{")}
        assert {"kubernetes", "loop", "prometheus"} <= enabled
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out


def test_trace_names_the_block_and_plugin(tmp_path):
    path = _corefile(tmp_path, 5301, 5302, 5303, 5304)
    r = _run("trace", "testapp-svc", "--corefile", str(path))
    assert r.returncode == 0, r.stderr
    assert f"{path}:2 kubernetes" in r.stdout
    assert "stops at testapp-svc.testapp.svc.cluster.local. -> 172.20.36.232" in r.stdout


async def test_trace_in_process_names_the_block_and_plugin_of_each_question(tmp_path):
    """trace through a Corefile: a forwarded name shows the block and `forward` (with its note), a
    cluster name `kubernetes`."""
    from clusterdns.config import Config
    from clusterdns.sources.manifest import publish
    from clusterdns.state import StateStore
    from clusterdns.trace import build_trace, format_text
    from tests import demo
    from tests.dns.dnskit import FakeUpstream
    up = await FakeUpstream({"www.example.org.": ["www.example.org. 300 IN A 192.0.2.80"]}).start()
    try:
        path = tmp_path / "Corefile"
        path.write_text(f""".:5399 {{
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa
    forward . 127.0.0.1:{up.port}
    cache 30
}}
""")
        store = StateStore()
        publish(store, demo.demo_records())
        cfg = Config.from_options("trace", corefile=str(path), name="www.example.org.")
        data = await build_trace(cfg, store.current)
        q = data["walk"]["queries"]
        assert q[0]["name"] == "www.example.org." and q[0]["plugin"] == "forward"
        assert q[0]["block"] == f"{path}:1" and q[0]["rcode"] == "NOERROR"
        assert any("forward ." in t for t in q[0]["trail"])
        text = format_text(data)
        assert f"{path}:1 forward" in text and "192.0.2.80" in text
        cfg2 = Config.from_options("trace", corefile=str(path), name="testapp-svc", from_pod="testapp/client")
        data = await build_trace(cfg2, store.current)
        assert data["walk"]["stopped_at"] == "testapp-svc.testapp.svc.cluster.local.", format_text(data)
        assert [x["plugin"] for x in data["walk"]["queries"] if x["type"] == "A"] == ["kubernetes"]
    finally:
        await up.stop()


async def test_trace_names_the_upstream_that_answered_and_a_cache_hit(tmp_path):
    """A forwarded step names the upstream whose reply was used (the dead one tried first is
    in the notes); asked again, the step is the cache's hit."""
    from clusterdns.config import Config
    from clusterdns.corefile.build import prepare
    from clusterdns.sources.manifest import publish
    from clusterdns.state import StateStore
    from clusterdns.trace import CorefileAsker, build_trace, format_text
    from tests import demo
    from tests.dns.dnskit import FakeUpstream
    ups = [await FakeUpstream({"www.example.org.": [f"www.example.org. 300 IN A 192.0.2.{i}"],
                               "www.stub.example.": [f"www.stub.example. 300 IN A 198.51.100.{i}"]}).start()
           for i in (1, 2)]
    dead = free_port()          # nothing listens there: refused at once
    try:
        path = tmp_path / "Corefile"
        path.write_text(f""".:5399 {{
    kubernetes cluster.local in-addr.arpa ip6.arpa
    forward . 127.0.0.1:{dead} 127.0.0.1:{ups[0].port} {{
        policy sequential
    }}
    cache 30
}}
stub.example:5399 {{
    forward . 127.0.0.1:{ups[1].port}
}}
""")
        store = StateStore()
        publish(store, demo.demo_records())
        for name, up, block, ip in (("www.example.org.", ups[0], 1, "192.0.2.1"),
                                    ("www.stub.example.", ups[1], 8, "198.51.100.2")):
            cfg = Config.from_options("trace", corefile=str(path), name=name)
            data = await build_trace(cfg, store.current)
            q = [x for x in data["walk"]["queries"] if x["type"] == "A"][0]
            assert (q["plugin"], q["upstream"], q["cache"]) == ("forward", f"127.0.0.1:{up.port}", ""), q
            text = format_text(data)
            assert f"{path}:{block} forward 127.0.0.1:{up.port}" in text, text
            assert ip in text
        trail = "; ".join(q["trail"])
        assert f"from 127.0.0.1:{ups[1].port} over tcp" in trail and "tried" not in trail, trail
        cfg = Config.from_options("trace", corefile=str(path), name="www.example.org.")
        data = await build_trace(cfg, store.current)
        trail = "; ".join(next(x for x in data["walk"]["queries"] if x["type"] == "A")["trail"])
        assert "cache: miss" in trail and f"from 127.0.0.1:{ups[0].port} over tcp (tried 127.0.0.1:{dead} over tcp:" \
            in trail, trail
        # the same Corefile asked twice: the second answer is the cache's
        corefile, _ = prepare(cfg)
        corefile.update(store.current)
        asker = CorefileAsker(corefile, corefile.listeners[("0.0.0.0", 5399)], "127.0.0.1")
        first = await asker.ask("www.example.org.", "A")
        w = asker.where("www.example.org.")
        assert (w["plugin"], w["upstream"], w["cache"]) == ("forward", f"127.0.0.1:{ups[0].port}", "")
        asked = len(ups[0].received)
        second = await asker.ask("www.example.org.", "A")
        w = asker.where("www.example.org.")
        assert (w["plugin"], w["upstream"], w["cache"]) == ("cache", "", "hit"), w
        assert any(t.startswith("cache: hit (success, stored") for t in w["trail"]), w
        assert first.answer == second.answer
        assert len(ups[0].received) == asked          # the second did not reach the upstream
    finally:
        for up in ups:
            await up.stop()


def test_agent_reload_plugin_serves_a_changed_corefile_and_keeps_serving_a_broken_one(tmp_path):
    dns_port, prom = free_port(), free_port()
    path = tmp_path / "Corefile"
    text = f""".:{dns_port} {{
    bind 127.0.0.1
    reload 2s 1s
    prometheus 127.0.0.1:{prom}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
       ttl 30
    }}
}}
"""
    path.write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "clusterdns", "agent", "--corefile", str(path), "--manifest",
                             str(ROOT / "examples" / "demo-cluster.yaml"), "--proxy-mode", "none", "--dry-run"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    q = dns.message.make_query("testapp-svc.testapp.svc.cluster.local", "A")

    def ttl() -> int | None:
        try:
            r = dns.query.udp(q, "127.0.0.1", port=dns_port, timeout=0.5)
        except Exception:
            return None
        return r.answer[0].ttl if r.answer else None

    def wait_ttl(want: int, seconds: float) -> int | None:
        deadline, got = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            got = ttl()
            if got == want:
                return got
            time.sleep(0.1)
        return got

    try:
        assert wait_ttl(30, 30) == 30
        path.write_text(text.replace("ttl 30", "ttl 12"))
        assert wait_ttl(12, 15) == 12, "the reload plugin serves the changed Corefile"
        path.write_text(text.replace("ttl 30", "ttl 99999"))      # a setup error
        deadline = time.monotonic() + 15
        failed = 0.0
        while time.monotonic() < deadline and not failed:
            _code, metrics_text = _get(prom, "/metrics")
            failed = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics_text.splitlines()
                         if ln.startswith("coredns_reload_failed_total"))
            time.sleep(0.2)
        assert failed >= 1
        assert ttl() == 12, "the running configuration keeps serving"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "plugin/reload: Corefile changed but reload failed" in out and "ttl must be in range" in out
