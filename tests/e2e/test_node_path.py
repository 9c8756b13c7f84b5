"""The whole node path in network namespaces: a pod's resolver -> clusterdns DNS on the
node's local kube-dns address -> the ClusterIP -> the proxier's rules -> a backend Pod.

    client 10.161.37.5 --veth--+
    be0 10.161.1.10 -----veth--+-- node (clusterdns agent; 172.20.0.10 on nodelocaldns;
    be1 10.161.1.11 -----veth--+         10.161.0.1 towards every pod, routed /32s)
    be2 10.161.1.12 -----veth--+

The client's /etc/netns/<client>/resolv.conf is a pod's: search
testapp.svc.cluster.local svc.cluster.local cluster.local, nameserver
172.20.0.10, ndots:5; `ip netns exec` mounts it over /etc/resolv.conf, so
`getent hosts testapp-svc` goes through the real glibc resolver. kube-dns has
no endpoints: the proxier REJECTs its ClusterIP, and the agent's local DNS
must answer anyway.

Run with the state from a manifest file (iptables and nftables proxier), and
from tests/fakeapi.py through --kubeconfig (updates, deletes, bookmarks, 410
Gone, dropped watches, an outage). The fake API server's thread is started inside the node namespace
(setns in the creating thread) so the agent reaches it on its own 127.0.0.1.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import textwrap
import time

import pytest

from tests.fakeapi import FakeAPIServer, endpoint_slice, namespace, service
from tests.nslib import POD_RESOLV, PY, Namespaces, requires, sh, skip_unless, write_manifest

NSS_TAG = "e2e"
NODE, CLIENT = Namespaces(NSS_TAG).name("node"), Namespaces(NSS_TAG).name("client")
BACKENDS = {f"be{i}": f"10.161.1.{10 + i}" for i in range(3)}
CLIENT_IP = "10.161.37.5"
GW = "10.161.0.1"
KUBE_DNS = "172.20.0.10"
SVC_IP, NEW_IP = "172.20.36.232", "172.20.40.40"
HEALTH = "127.0.0.1:18089"

pytestmark = [pytest.mark.root, pytest.mark.slow, requires("iptables-nft-restore", "dig", "getent", "curl")]

# Connects by name COUNT times; prints the backend names that answered (or errors).
# Backends (tests/nslib/netserver.py) answer "<name> <peer>".
CLIENT_SCRIPT = textwrap.dedent("""
    import json, socket, sys
    name, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = []
    for _ in range(count):
        try:
            with socket.create_connection((name, port), timeout=2) as c:
                out.append((c.recv(64).decode().split() or ["empty"])[0])
        except OSError as exc:
            out.append("error:" + exc.__class__.__name__)
    print(json.dumps(out))
""")

# Waits for "go", then polls until the new Service resolves (glibc, search list) and
# answers, and until connections to testapp-svc stop reaching the removed backend.
WATCHER = textwrap.dedent("""
    import json, socket, sys, time
    new, removed = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    t_new = t_gone = clean_since = None
    clean = 0
    seen_after = []
    def hit(name):
        try:
            with socket.create_connection((name, 8080), timeout=1) as c:
                return (c.recv(64).decode().split() or ["empty"])[0]
        except OSError as exc:
            return "error:" + exc.__class__.__name__
    while time.monotonic() - t0 < 5 and (t_new is None or t_gone is None or time.monotonic() - t_gone < 1):
        if t_new is None and hit(new).startswith("be"):
            t_new = time.monotonic() - t0
        start = time.monotonic() - t0
        names = [hit("testapp-svc") for _ in range(10)]
        if t_gone is None:
            # Gone once 3 batches in a row (30 connections) miss it: one batch of 10 misses
            # a live endpoint of 3 by chance 1.7% of the time; 30 in a row, 5 in a million.
            if removed not in names and all(n.startswith("be") for n in names):
                clean_since = start if clean_since is None else clean_since
                clean += 1
                if clean >= 3:
                    t_gone = clean_since
            else:
                clean_since, clean = None, 0
        else:
            seen_after += names
        time.sleep(0.01)
    print(json.dumps({"t_new": t_new, "t_gone": t_gone, "after": seen_after}))
""")


# ---------------------------------------------------------------- topology

class Topology:
    """client and three backends, each a routed pod of the node."""

    def __init__(self) -> None:
        self.nss = Namespaces(NSS_TAG)

    def up(self) -> None:
        nss = self.nss
        node = nss.add("node")
        nss.sysctl(node, net__ipv4__ip_forward="1")
        sh("ip", "addr", "add", "192.168.49.2/32", "dev", "lo", ns=node)
        for i, (name, ip) in enumerate([("client", CLIENT_IP), *BACKENDS.items()]):
            pod = nss.add(name)
            nss.veth(node, f"v{i}", pod, "eth0")
            nss.routed_pod(node, f"v{i}", pod, ip, GW)
        nss.resolv_conf(CLIENT, POD_RESOLV)
        for name in BACKENDS:
            nss.backend(nss.name(name), name, 8080)

    def down(self) -> None:
        self.nss.close()


@pytest.fixture
def topo():
    t = Topology()
    try:
        t.up()
        yield t
    finally:
        t.down()


@contextlib.contextmanager
def in_netns(name: str):
    """Run the calling thread (and threads it starts) in a network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, 0x40000000) != 0:     # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns")
        yield
    finally:
        libc.setns(back, 0x40000000)
        os.close(back)
        os.close(target)


# ---------------------------------------------------------------- state

def objects(endpoints=("be0", "be1", "be2"), new_service=False) -> list[dict]:
    objs = [namespace("testapp"), namespace("kube-system"),
            service("kube-system", "kube-dns", KUBE_DNS, ports=(("dns", 53, "UDP"), ("dns-tcp", 53, "TCP"))),
            service("testapp", "testapp-svc", SVC_IP, ports=(("http", 8080, "TCP"),)),
            endpoint_slice("testapp", "testapp-svc", [BACKENDS[b] for b in endpoints], port=8080)]
    if new_service:
        objs += [service("testapp", "testapp-new", NEW_IP, ports=(("http", 8080, "TCP"),)),
                 endpoint_slice("testapp", "testapp-new", [BACKENDS["be2"]], port=8080)]
    return objs


# ---------------------------------------------------------------- the agent

class AgentProc:
    def __init__(self, log_path, *source_args: str, mode: str = "iptables") -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        argv = ["ip", "netns", "exec", NODE, PY, "-m", "clusterdns", "agent", *source_args,
                "--local-ip", KUBE_DNS, "--node-ip", "192.168.49.2", "--node-name", "node-a",
                "--cluster-cidr", "10.161.0.0/16", "--proxy-mode", mode, "--apply",
                "--min-sync-period", "0", "--no-upstream", "--lameduck", "0",
                "--health-listen", HEALTH, "--metrics-listen", "none", "--loop", "asyncio"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=os.getcwd())

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path) as fh:
            return fh.read()

    def wait_ready(self, timeout=20.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"agent exited:\n{self.logs()}"
            res = subprocess.run(["ip", "netns", "exec", NODE, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                  f"http://{HEALTH}/ready"], capture_output=True, text=True)
            if res.stdout == "200":
                return
            time.sleep(0.1)
        raise AssertionError(f"agent not ready:\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- checks

def connect_by_name(name="testapp-svc", count=60) -> list[str]:
    return json.loads(sh(PY, "-c", CLIENT_SCRIPT, name, "8080", str(count), ns=CLIENT, timeout=60))


def check_served(backends=("be0", "be1", "be2")) -> None:
    got = sh("getent", "hosts", "testapp-svc", ns=CLIENT).split()
    assert got[:2] == [SVC_IP, "testapp-svc.testapp.svc.cluster.local"], got
    for tcp in ("+notcp", "+tcp"):
        ans = sh("dig", f"@{KUBE_DNS}", "+short", "+time=2", "+tries=1", tcp,
                 "testapp-svc.testapp.svc.cluster.local", ns=CLIENT).split()
        assert ans == [SVC_IP]
    names = connect_by_name()
    assert set(names) == set(backends), names      # every backend, and only backends


def change_and_measure(apply_change) -> dict:
    """Apply a change at the source (remove be0, add testapp-new); the seconds until DNS and
    traffic follow, seen from the client pod."""
    w = subprocess.Popen(["ip", "netns", "exec", CLIENT, PY, "-c", WATCHER, "testapp-new", "be0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        apply_change()
        w.stdin.write("go\n")
        w.stdin.flush()
        out, _ = w.communicate(timeout=20)
    finally:
        if w.poll() is None:
            w.kill()
    return json.loads(out)


def check_change(result: dict, agent: AgentProc) -> None:
    print(f"change -> new Service answering by name: {result['t_new']:.3f}s; "
          f"removed endpoint no longer reached: {result['t_gone']:.3f}s")
    assert result["t_new"] is not None and result["t_new"] < 1.0, (result, agent.logs()[-3000:])
    assert result["t_gone"] is not None and result["t_gone"] < 1.0, (result, agent.logs()[-3000:])
    assert "be0" not in result["after"] and set(result["after"]) <= {"be1", "be2"}, result
    assert sh("getent", "hosts", "testapp-new", ns=CLIENT).split()[0] == NEW_IP


def check_unchanged_for(seconds: float, backends=("be1", "be2")) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ans = sh("dig", f"@{KUBE_DNS}", "+short", "+time=2", "+tries=1",
                 "testapp-new.testapp.svc.cluster.local", ns=CLIENT).split()
        assert ans == [NEW_IP]
        names = connect_by_name(count=20)
        assert set(names) <= set(backends) and names, names
        time.sleep(0.2)


def wait_for(pred, agent: AgentProc, what: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{agent.logs()[-3000:]}")


# ---------------------------------------------------------------- the two runs

@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_node_path_from_manifest(topo, tmp_path, mode):
    if mode == "nftables":
        skip_unless("nft")
    path = str(tmp_path / "cluster.json")
    write_manifest(path, objects())
    agent = AgentProc(str(tmp_path / "agent.log"), "--manifest", path, mode=mode)
    try:
        agent.wait_ready()
        check_served()
        result = change_and_measure(lambda: write_manifest(path, objects(("be1", "be2"), new_service=True)))
        check_change(result, agent)
        # The manifest breaks (the source's outage): the last good state keeps being served.
        with open(path, "w") as fh:
            fh.write("{ this is not json")
        check_unchanged_for(1.5)
        assert "keeping the last good state" in agent.logs()
        # Fixed again: changes flow.
        write_manifest(path, objects(("be0", "be1", "be2"), new_service=False))
        wait_for(lambda: not sh("getent", "hosts", "testapp-new", ns=CLIENT, check=False).strip(),
                 agent, "testapp-new gone")
        check_served()
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.logs()[-3000:]


def test_node_path_from_fake_api_server(topo, tmp_path):
    with in_netns(NODE):
        api = FakeAPIServer(bookmark_interval=0.5).start()
    try:
        api.add_all(objects())
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        agent = AgentProc(str(tmp_path / "agent.log"), "--kubeconfig", kubeconfig)
        try:
            agent.wait_ready()
            check_served()

            def change():
                api.update(endpoint_slice("testapp", "testapp-svc", [BACKENDS["be1"], BACKENDS["be2"]], port=8080))
                api.add(service("testapp", "testapp-new", NEW_IP, ports=(("http", 8080, "TCP"),)))
                api.add(endpoint_slice("testapp", "testapp-new", [BACKENDS["be2"]], port=8080))
            check_change(change_and_measure(change), agent)

            # Bookmarks and dropped watch connections: the reflectors re-watch, nothing
            # served changes, and the next change still flows.
            api.bookmark()
            api.drop_watches()
            check_unchanged_for(0.5)
            api.update(endpoint_slice("testapp", "testapp-svc", list(BACKENDS.values()), port=8080))
            wait_for(lambda: set(connect_by_name(count=30)) == {"be0", "be1", "be2"}, agent, "be0 back")

            # An outage: everything keeps being served as it was...
            lists = len(api.requests_for("services", "list"))
            api.stop()
            check_unchanged_for(2.0, backends=("be0", "be1", "be2"))
            # ...while the source changes and compacts its history (410 Gone on re-watch).
            api.delete("services", "testapp-new", "testapp")
            api.compact()
            api.start()
            # After the reconnect the agent re-lists; the deleted Service leaves DNS.
            wait_for(lambda: not sh("getent", "hosts", "testapp-new", ns=CLIENT, check=False).strip(),
                     agent, "testapp-new gone after the outage")
            assert len(api.requests_for("services", "list")) > lists, "no re-list after 410"
            check_served(("be0", "be1", "be2"))
        finally:
            agent.stop()
        assert agent.proc.returncode == 0, agent.logs()[-3000:]
    finally:
        api.close()
