"""`clusterdns config check`: validate a configuration and print what it makes effective.

With --corefile: each server block's zones, the listeners it is bound to and its
plugins in the order they run (CoreDNS's plugin order, not the file's), then the
process-wide settings (health, ready, metrics, lameduck, reload). Errors exit 2
with FILE:LINE.

With --proxy-config (or without --corefile): the proxier's settings, each beside
where it came from: what kube-proxy's file becomes after decoding, defaulting,
the mode's section and validation (a bad file has already exited 2 in
config.load, one line naming the field), else what the proxy flags (clusterdns's
or kube-proxy's own) give. Warnings (lenient decoding, ignored flags, fields not
applied) go to stderr.
"""
from __future__ import annotations

import os
import sys

from .. import kpconfig
from ..config import Config
from ..errors import UsageError
from ..proxy.sysctl import conntrack_max


def _dur(seconds: float) -> str:
    return kpconfig.format_duration(round(seconds * 1e9))


def proxy_report(cfg: Config) -> list[tuple[str, str, str]]:
    """(setting, value, where from) rows."""
    px, ag = cfg.proxy, cfg.agent
    kp = kpconfig.loaded(px.proxy_config) if px.proxy_config else None
    t = kp.tree if kp else None
    mode = px.proxy_mode

    def src(field: str, flag: str) -> str:
        return field if kp else flag

    section = "ipvs" if mode == "ipvs" else "nftables" if mode == "nftables" else "iptables"
    masq_section = "nftables" if mode == "nftables" else "iptables"
    rows = [
        ("mode", mode, src(f"mode {t['mode']!r}" if t else "", "--proxy-mode")),
        ("node name", px.node_name or "(none: no local endpoints)",
         "--hostname-override/--node-name/NODE_NAME, else hostnameOverride, else the host name" if kp
         else "--node-name/--hostname-override/NODE_NAME"),
        ("node IPs", ", ".join(px.node_ips) or "from the Node object", src("bindAddress", "--node-ip/--bind-address")),
        ("sync period", _dur(px.sync_period), src(f"{section}.syncPeriod", "--sync-period")),
        ("min sync period", _dur(px.min_sync_period), src(f"{section}.minSyncPeriod", "--min-sync-period")),
        ("masquerade all", str(px.masquerade_all).lower(), src(f"{masq_section}.masqueradeAll", "--masquerade-all")),
        ("masquerade bit", f"{px.masquerade_bit} (mark {hex(1 << px.masquerade_bit)})",
         src(f"{masq_section}.masqueradeBit", "--masquerade-bit")),
    ]
    if mode == "iptables":
        rows.append(("localhost NodePorts", str(px.localhost_nodeports).lower(),
                     src("iptables.localhostNodePorts", "--no-localhost-nodeports")))
    if px.detect_local_mode == "BridgeInterface":
        local, where = f"in on {px.pod_bridge_interface}", "detectLocalMode, detectLocal.bridgeInterface"
    elif px.detect_local_mode == "InterfaceNamePrefix":
        local, where = f"in on {px.pod_interface_name_prefix}*", "detectLocalMode, detectLocal.interfaceNamePrefix"
    else:
        local = f"source in {', '.join(px.cluster_cidrs)}" if px.cluster_cidrs else "none (no cluster CIDR)"
        where = "detectLocalMode ClusterCIDR, clusterCIDR"
    rows.append(("local traffic", local, src(where, "--detect-local-mode, --cluster-cidr")))
    rows.append(("NodePort addresses", ", ".join(px.nodeport_addresses) or "every local address",
                 src("nodePortAddresses", "--nodeport-addresses")))
    if mode == "ipvs":
        rows += [("ipvs scheduler", px.ipvs_scheduler, src("ipvs.scheduler", "--ipvs-scheduler")),
                 ("ipvs exclude CIDRs", ", ".join(px.ipvs_exclude_cidrs) or "none",
                  src("ipvs.excludeCIDRs", "--ipvs-exclude-cidrs")),
                 ("ipvs strict ARP", str(px.ipvs_strict_arp).lower(), src("ipvs.strictARP", "--ipvs-strict-arp"))]
    rows.append(("healthz", (ag.proxy_health_listen + " (/healthz, /livez)") if ag.proxy_health_listen
                 else f"on --health-listen {ag.health_listen}", src("healthzBindAddress", "--healthz-bind-address")))
    rows.append(("metrics", f"{ag.proxy_metrics_listen} (/metrics, /proxyMode)",
                 src("metricsBindAddress", "--proxy-metrics-listen/--metrics-bind-address")))
    ct = px.conntrack
    if ct is None:
        rows.append(("conntrack", "left alone", "no --proxy-config or --conntrack-* flag"))
    else:
        cpus = os.cpu_count() or 1
        maximum = conntrack_max(ct, cpus)
        rows.append(("nf_conntrack_max",
                     f"max({ct.max_per_core} x {cpus} CPUs, {ct.min}) = {maximum}, hashsize >= {maximum // 4}"
                     if maximum else "left alone (maxPerCore 0)", src("conntrack.maxPerCore, conntrack.min",
                                                                     "--conntrack-max-per-core, --conntrack-min")))
        for name, value, field, flag in (
                ("tcp established timeout", ct.tcp_established_timeout, "tcpEstablishedTimeout",
                 "tcp-timeout-established"),
                ("tcp close-wait timeout", ct.tcp_close_wait_timeout, "tcpCloseWaitTimeout", "tcp-timeout-close-wait"),
                ("udp timeout", ct.udp_timeout, "udpTimeout", "udp-timeout"),
                ("udp stream timeout", ct.udp_stream_timeout, "udpStreamTimeout", "udp-timeout-stream")):
            rows.append((name, f"{value}s" if value else "left alone (0)",
                         src(f"conntrack.{field}", f"--conntrack-{flag}")))
        rows.append(("tcp be liberal", "1" if ct.tcp_be_liberal else "left alone (false)",
                     src("conntrack.tcpBeLiberal", "--conntrack-tcp-be-liberal")))
    rows.append(("oom_score_adj", "left alone" if px.oom_score_adj is None else str(px.oom_score_adj),
                 src("oomScoreAdj", "--oom-score-adj")))
    if kp is not None:
        rows.append(("config sync period", kpconfig.format_duration(kp.tree["configSyncPeriod"]) + " (no effect)",
                     "configSyncPeriod"))
        unused = kpconfig.not_applied(kp)
        if unused:
            rows.append(("not applied", "; ".join(unused), "(set away from the default)"))
        if kp.lenient:
            rows.append(("lenient decoding", ", ".join(kp.lenient), "(ignored, as kube-proxy ignores them)"))
    return rows


def run(cfg: Config) -> int:
    if cfg.run.action != "check":
        raise UsageError("config: the only action is check")
    if cfg.dns.corefile:
        from ..corefile.build import prepare
        cf, _effective = prepare(cfg, os.environ.get("KUBE_DNS_SERVICE_HOST"))
        print(cf.describe())
        if not cfg.proxy.proxy_config:
            return 0
    px = cfg.proxy
    if px.proxy_config:
        kp = kpconfig.loaded(px.proxy_config)
        print(f"# {kp.source}: {kpconfig.KIND} {kpconfig.API_VERSION}, valid")
    else:
        print("# proxier settings from the flags (no --proxy-config)")
    rows = proxy_report(cfg)
    width = max(len(r[0]) for r in rows)
    vwidth = min(max(len(r[1]) for r in rows), 48)
    for name, value, where in rows:
        print(f"{name.ljust(width)}  {value.ljust(vwidth)}  {('# ' + where) if where else ''}".rstrip())
    sys.stdout.flush()
    return 0
