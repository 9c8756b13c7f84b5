"""A one-node cluster in network namespaces, for real-traffic proxier tests.

    ext (192.168.49.100, .101)  --veth--  node (192.168.49.2; 10.161.0.1 on every pod veth)
                                            |-- veth /32 --  pod0 10.161.1.10   (node-a: local)
                                            |-- veth /32 --  pod1 10.161.1.11   (node-b)
                                            |-- veth /32 --  pod2 10.161.1.12   (node-b)
                                            |-- veth /32 --  pod3 10.161.1.13   (not ready)
                                            `-- veth /32 --  client 10.161.37.5 (no server)

Pods are routed, not bridged (each has a /32 and a default route via
10.161.0.1), so every packet between pods crosses the node's netfilter hooks,
as on a real node with a routed CNI. Backends answer "<name> <peer>", so a
test sees both which endpoint it reached and whether it was masqueraded.
`clusterdns proxy` runs in the node namespace on a manifest the test writes.
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field

from tests.nslib import PY, Namespaces, connect, missing, sh

NODE_IP = "192.168.49.2"
NODE_POD_GW = "10.161.0.1"          # the node's address towards pods: what masquerade shows
EXT_IPS = ("192.168.49.100", "192.168.49.101")
CLUSTER_CIDR = "10.161.0.0/16"
# IPv6: the same layout, so a dual-stack node programs both families.
NODE_IP6 = "fd00:49::2"
NODE_POD_GW6 = "fd00:161::1"
EXT_IP6 = "fd00:49::100"
CLUSTER_CIDR6 = "fd00:161::/32"
PODS6 = {"pod0": "fd00:161:1::10", "pod1": "fd00:161:1::11", "pod2": "fd00:161:1::12",
         "pod3": "fd00:161:1::13", "client": "fd00:161:37::5"}
PODS = {"pod0": "10.161.1.10", "pod1": "10.161.1.11", "pod2": "10.161.1.12", "pod3": "10.161.1.13",
        "client": "10.161.37.5"}
BACKENDS = ("pod0", "pod1", "pod2", "pod3")
TCP_PORT, UDP_PORT = 8080, 5353


def missing_requirements(modes=("iptables",)) -> str:
    tools = ["conntrack"] + (["iptables-nft-restore"] if "iptables" in modes else []) + \
        (["nft"] if "nftables" in modes else [])
    return missing(*tools)


@dataclass
class Outcome:
    answers: list
    errors: dict
    local: str

    @property
    def names(self) -> set[str]:
        return {a[0] for a in self.answers}

    @property
    def peers(self) -> set[str]:
        return {a[1] for a in self.answers}

    def verdict(self):
        """('ok', endpoints, masqueraded) | ('refused',) | ('timeout',) | ('mixed', ...)."""
        if self.answers and not self.errors:
            masq = {peer != self.local for _, peer in self.answers}
            if len(masq) == 1:
                return ("ok", frozenset(self.names), masq.pop())
        if not self.answers and set(self.errors) == {"refused"}:
            return ("refused",)
        if not self.answers and set(self.errors) == {"timeout"}:
            return ("timeout",)
        return ("mixed", sorted(self.names), self.errors, sorted(self.peers), self.local)


@dataclass
class Cluster:
    nss: Namespaces = field(default_factory=lambda: Namespaces("cl"))

    def ns(self, name: str) -> str:
        return self.nss.name(name)

    @property
    def node(self) -> str:
        return self.ns("node")

    # -- build and tear down
    def up(self) -> None:
        nss = self.nss
        for name in ["node", "ext", *PODS]:
            nss.add(name)
        node = self.node
        # No ICMP redirects: the node forwards ext's packets for unassigned
        # addresses back out the link they came from, and ext would act on a
        # redirect instead of seeing the REJECT. No ICMP rate limit: a test sends
        # bursts of probes that must each be rejected (port unreachable), and the
        # kernel's per-peer limit would drop some (a "timeout" instead of "refused").
        nss.sysctl(node, net__ipv4__icmp_ratelimit="0", net__ipv6__icmp__ratelimit="0",
                   net__ipv4__ip_forward="1", net__ipv4__conf__all__route_localnet="1",
                   net__ipv4__conf__all__rp_filter="0", net__ipv4__conf__default__rp_filter="0",
                   net__ipv4__conf__all__send_redirects="0", net__ipv4__conf__default__send_redirects="0",
                   net__ipv6__conf__all__forwarding="1")
        ext = self.ns("ext")
        nss.veth(node, "to-ext", ext, "eth0")
        sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", "to-ext", ns=node)
        for ip in EXT_IPS:
            sh("ip", "addr", "add", f"{ip}/24", "dev", "eth0", ns=ext)
        sh("ip", "addr", "add", f"{NODE_IP6}/64", "dev", "to-ext", "nodad", ns=node)
        sh("ip", "addr", "add", f"{EXT_IP6}/64", "dev", "eth0", "nodad", ns=ext)
        # External clients reach service addresses through the node.
        for dst in ("172.30.0.0/16", "192.0.2.0/24", CLUSTER_CIDR):
            sh("ip", "route", "add", dst, "via", NODE_IP, ns=ext)
        for dst in ("fd00:30::/64", CLUSTER_CIDR6):
            sh("ip", "-6", "route", "add", dst, "via", NODE_IP6, ns=ext)
        # The node needs a route for ClusterIPs before DNAT picks the real one.
        sh("ip", "route", "add", "default", "via", EXT_IPS[0], ns=node)
        sh("ip", "-6", "route", "add", "default", "via", EXT_IP6, ns=node)
        for i, (name, ip) in enumerate(PODS.items()):
            pod, dev = self.ns(name), f"vp{i}"
            nss.veth(node, dev, pod, "eth0")
            nss.routed_pod(node, dev, pod, ip, NODE_POD_GW)
            nss.routed_pod(node, dev, pod, PODS6[name], NODE_POD_GW6)
        self.add_foreign_rules()
        for name in BACKENDS:
            nss.backend(self.ns(name), name, TCP_PORT, UDP_PORT)
        deadline = time.monotonic() + 10
        for name in BACKENDS:
            while True:
                out = self.connect("node", "tcp", PODS[name], TCP_PORT, 1, timeout=0.5)
                out6 = self.connect("node", "tcp", PODS6[name], TCP_PORT, 1, timeout=0.5)
                if out.names == {name} and out6.names == {name}:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"backend {name} did not start: {out}")
                time.sleep(0.05)

    def add_foreign_rules(self) -> None:
        """Rules another program owns: cleanup must leave them exactly as they are."""
        node = self.node
        sh("iptables-nft", "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "9999", "-j", "ACCEPT", ns=node)
        sh("iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-s", "10.99.0.0/16", "-j", "RETURN", ns=node)
        sh("iptables-nft", "-t", "mangle", "-A", "PREROUTING", "-p", "udp", "--dport", "9999", "-j", "RETURN",
           ns=node)
        sh("ip6tables-nft", "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "9999", "-j", "ACCEPT", ns=node)
        sh("ip6tables-nft", "-t", "nat", "-A", "POSTROUTING", "-s", "fd00:99::/64", "-j", "RETURN", ns=node)
        sh("ip6tables-nft", "-t", "mangle", "-A", "PREROUTING", "-p", "udp", "--dport", "9999", "-j", "RETURN",
           ns=node)
        sh("nft", "-f", "-", ns=node, input=(
            "table inet foreign {\n chain c {\n  type filter hook input priority 10; policy accept;\n"
            "  tcp dport 9998 accept\n }\n}\n"))

    def down(self) -> None:
        self.nss.close()

    # -- traffic
    def connect(self, src: str, proto: str, host: str, port: int, count: int, *, bind: str = "",
                sport: int = 0, timeout: float = 1.0, path: str = "/") -> Outcome:
        out = connect(self.ns(src), proto, host, port, count, bind=bind, sport=sport, timeout=timeout, path=path)
        return Outcome(out["answers"], out["errors"], out["local"])

    def save_rules(self) -> str:
        """iptables and nftables state of the node, without counters and comments.

        iptables-nft creates a built-in chain (an empty nft base chain with policy
        accept) the first time a rule refers to it, and nobody deletes those: they
        have no effect and iptables-save shows them either way, so they are left out."""
        ruleset = re.sub(r"\n?\tchain \S+ \{\n\t\ttype [^\n]*policy accept;\n\t\}\n", "",
                         sh("nft", "list", "ruleset", ns=self.node))
        text = sh("iptables-nft-save", ns=self.node) + sh("ip6tables-nft-save", ns=self.node) + ruleset
        lines = []
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            if line.startswith(":"):
                line = line.split("[")[0]
            lines.append(line)
        return "\n".join(lines)


# ---------------------------------------------------------------- manifest

def service(name, ip, ports, *, type_="ClusterIP", external_ips=(), lb_ip="", ranges=(), local=False,
            hcnp=0, affinity=False, internal_local=False) -> dict:
    spec = {"type": type_, "clusterIP": ip, "clusterIPs": [ip], "ports": ports}
    if internal_local:
        spec["internalTrafficPolicy"] = "Local"
    if external_ips:
        spec["externalIPs"] = list(external_ips)
    if ranges:
        spec["loadBalancerSourceRanges"] = list(ranges)
    if local:
        spec["externalTrafficPolicy"] = "Local"
    if hcnp:
        spec["healthCheckNodePort"] = hcnp
    if affinity:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "t"}, "spec": spec}
    if lb_ip:
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}
    return obj


def dual_stack_service(name, ips, ports) -> dict:
    obj = service(name, ips[0], ports)
    obj["spec"].update({"clusterIPs": list(ips), "ipFamilies": ["IPv4", "IPv6"],
                        "ipFamilyPolicy": "RequireDualStack"})
    return obj


def port(name, proto, number, node_port=0) -> dict:
    out = {"name": name, "protocol": proto, "port": number}
    if node_port:
        out["nodePort"] = node_port
    return out


def slice_(svc, pods, ports, *, not_ready=(), nodes=None, family=4, terminating=()) -> dict:
    nodes = nodes or {}
    addrs = PODS if family == 4 else PODS6
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{svc}-x{family}", "namespace": "t",
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": f"IPv{family}",
        "endpoints": [{"addresses": [addrs[p]],
                       "conditions": {"ready": p not in not_ready and p not in terminating,
                                      "serving": p not in not_ready, "terminating": p in terminating},
                       "nodeName": nodes.get(p, "node-b"),
                       "targetRef": {"kind": "Pod", "name": p, "namespace": "t"}} for p in pods],
        "ports": ports}


HTTP = [port("http", "TCP", 80)]
HTTP_EP = [port("http", "TCP", TCP_PORT)]
DNS = [port("dns", "UDP", 53)]
DNS_EP = [port("dns", "UDP", UDP_PORT)]
LOCALITY = {"pod0": "node-a", "pod1": "node-b", "pod2": "node-b", "pod3": "node-b"}

# Service addresses used by the tests.
WEB, DNS_IP, NP_SVC, LOCAL_SVC, STICKY, EMPTY, HAIRPIN, LATE = (
    "172.30.0.10", "172.30.0.16", "172.30.0.11", "172.30.0.12", "172.30.0.13", "172.30.0.14", "172.30.0.15",
    "172.30.0.20")
EXTERNAL_IP, LB_IP = "192.0.2.50", "192.0.2.80"
WEB_DS, WEB_DS6 = "172.30.0.30", "fd00:30::30"
ITP_LOCAL, ITP_NONE_LOCAL, DRAINING, PART_DRAINING = "172.30.0.40", "172.30.0.41", "172.30.0.42", "172.30.0.43"
NP_CLUSTER, NP_LOCAL, HCNP = 30080, 30081, 30900


def manifest(dns_pods=("pod0", "pod1", "pod2"), late=False) -> dict:
    ready3 = ("pod0", "pod1", "pod2", "pod3")
    items = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "t"}},
        service("web", WEB, HTTP),
        slice_("web", ready3, HTTP_EP, not_ready=("pod3",)),
        service("dns", DNS_IP, DNS),
        slice_("dns", dns_pods, DNS_EP),
        service("web-np", NP_SVC, [port("http", "TCP", 80, NP_CLUSTER)], type_="NodePort",
                external_ips=(EXTERNAL_IP,)),
        slice_("web-np", ready3, HTTP_EP, not_ready=("pod3",)),
        service("web-local", LOCAL_SVC, [port("http", "TCP", 80, NP_LOCAL)], type_="LoadBalancer",
                lb_ip=LB_IP, ranges=(f"{EXT_IPS[0]}/32",), local=True, hcnp=HCNP),
        slice_("web-local", ("pod0", "pod1", "pod2"), HTTP_EP, nodes=LOCALITY),
        service("sticky", STICKY, HTTP, affinity=True),
        slice_("sticky", ("pod0", "pod1", "pod2"), HTTP_EP),
        service("empty", EMPTY, HTTP + DNS),
        *([service("late", LATE, DNS), slice_("late", ("pod1",), DNS_EP)] if late else []),
        dual_stack_service("web-ds", (WEB_DS, WEB_DS6), HTTP),
        slice_("web-ds", ready3, HTTP_EP, not_ready=("pod3",)),
        slice_("web-ds", ready3, HTTP_EP, not_ready=("pod3",), family=6),
        service("itp-local", ITP_LOCAL, HTTP, internal_local=True),
        slice_("itp-local", ("pod0", "pod1", "pod2"), HTTP_EP, nodes=LOCALITY),
        service("itp-none-local", ITP_NONE_LOCAL, HTTP, internal_local=True),
        slice_("itp-none-local", ("pod1", "pod2"), HTTP_EP, nodes=LOCALITY),
        # every endpoint terminating but still serving: used as a fallback
        service("draining", DRAINING, HTTP),
        slice_("draining", ("pod1", "pod2"), HTTP_EP, terminating=("pod1", "pod2")),
        # ready endpoints exist: the terminating one gets no new connections
        service("part-draining", PART_DRAINING, HTTP),
        slice_("part-draining", ("pod0", "pod1", "pod2"), HTTP_EP, terminating=("pod2",)),
        service("hairpin", HAIRPIN, HTTP),
        slice_("hairpin", ("pod0",), HTTP_EP),
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}


class Proxy:
    """`clusterdns proxy` running in the node namespace."""

    def __init__(self, cluster: Cluster, mode: str, manifest_path: str, log_path: str) -> None:
        self.cluster, self.mode, self.path, self.log_path = cluster, mode, manifest_path, log_path
        self.proc: subprocess.Popen | None = None

    def argv(self, *extra: str) -> list[str]:
        return ["ip", "netns", "exec", self.cluster.node, PY, "-m", "clusterdns", "proxy",
                "--manifest", self.path, "--node-ip", NODE_IP, "--node-ip", NODE_IP6, "--node-name", "node-a",
                "--cluster-cidr", CLUSTER_CIDR, "--cluster-cidr", CLUSTER_CIDR6, "--proxy-mode", self.mode, *extra]

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.argv("--apply", "--min-sync-period", "0.1", "--sync-period", "30",
                      "--health-listen", "127.0.0.1:10256", "--metrics-listen", "127.0.0.1:10256",
                      "--log-level", "debug"), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clusterdns proxy exited: {self.logs()}")
            out = self.cluster.connect("node", "http", "127.0.0.1", 10256, 1, timeout=0.5, path="/ready")
            if out.answers == [["200", ""]]:
                return
            time.sleep(0.1)
        raise RuntimeError(f"clusterdns proxy never became ready: {self.logs()}")

    def logs(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()[-3000:]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()

    def cleanup(self) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv("--cleanup"), capture_output=True, text=True, timeout=30)
