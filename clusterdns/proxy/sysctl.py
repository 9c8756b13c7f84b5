"""Host settings kube-proxy writes at start, before its first sync (server_linux.go, 1.29-1.35).

Conntrack (every mode, from conntrack.* or the --conntrack-* flags):

- nf_conntrack_max = max(maxPerCore x CPUs, min) when maxPerCore > 0 (0 leaves it,
  and min, alone); then the nf_conntrack hashsize is raised to max/4 unless it
  is already at least that. A read-only /sys (docker issue 24000) only skips
  the hashsize, with a warning, as kube-proxy does; any other failure is fatal.
- nf_conntrack_tcp_timeout_established / _close_wait, nf_conntrack_udp_timeout /
  _stream: whole seconds, when > 0; nf_conntrack_tcp_be_liberal = 1 when asked
  (false never resets it).
- Each sysctl is written only when it differs (1.29+ "set if different"), so an
  equal value under a read-only /proc/sys is fine; a different one is fatal
  (kube-proxy exits): in a non-initial network namespace nf_conntrack_max is
  read-only, which is why kind, k3s and RKE2 pass maxPerCore 0.

Also: ipvs strictARP (arp_ignore=1, arp_announce=2) and the process's own
oom_score_adj (a failure only logged, as kube-proxy's V(2) line).

`Host` holds the paths, so tests point it at a directory tree.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from ..config import Config, ConntrackConfig

log = logging.getLogger(__name__)


class SysctlError(Exception):
    """A host setting kube-proxy would have stopped on."""


def _cpus() -> int:
    # the node's CPUs, not the process cpuset (kubernetes issue 99225)
    return os.cpu_count() or 1


@dataclass
class Host:
    proc_sys: str = "/proc/sys"
    hashsize: str = "/sys/module/nf_conntrack/parameters/hashsize"
    mounts: str = "/proc/mounts"
    oom_score_adj: str = "/proc/self/oom_score_adj"
    cpus: Callable[[], int] = field(default=_cpus)

    def path(self, name: str) -> str:
        return os.path.join(self.proc_sys, name)


def conntrack_max(c: ConntrackConfig, cpus: int) -> int:
    """getConntrackMax: 0 = leave nf_conntrack_max alone."""
    if c.max_per_core > 0:
        scaled = c.max_per_core * cpus
        return scaled if scaled > c.min else c.min
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def set_sysctl(host: Host, name: str, value: int) -> bool:
    """Write /proc/sys/NAME unless it already holds value; True if written; SysctlError on failure."""
    path = host.path(name)
    if _read_int(path) == value:
        return False
    try:
        with open(path, "w") as fh:
            fh.write(f"{value}\n")
    except OSError as exc:
        raise SysctlError(f"cannot set {name} to {value}: {exc.strerror or exc}") from None
    log.info("set sysctl %s = %d", name, value)
    return True


def _sysfs_writable(host: Host) -> bool:
    """isSysFSWritable: the first sysfs mount's first option is rw; no sysfs at all is an error."""
    try:
        with open(host.mounts) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise SysctlError(f"cannot read {host.mounts}: {exc.strerror or exc}") from None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "sysfs":
            return parts[3].split(",")[0] == "rw"
    raise SysctlError("no sysfs mounted")


def set_max(host: Host, value: int) -> list[str]:
    changed = []
    if set_sysctl(host, "net/netfilter/nf_conntrack_max", value):
        changed.append(f"net/netfilter/nf_conntrack_max={value}")
    size = _read_int(host.hashsize)
    if size is None:
        raise SysctlError(f"cannot read {host.hashsize}")
    if size >= value // 4:
        return changed
    if not _sysfs_writable(host):
        log.warning("/sys is read-only: cannot modify conntrack limits, problems may arise later "
                    "(hashsize %d stays below %d; if running Docker, see docker issue #24000)", size, value // 4)
        return changed
    try:
        with open(host.hashsize, "w") as fh:
            fh.write(f"{value // 4}\n")
    except OSError as exc:
        raise SysctlError(f"cannot set {host.hashsize} to {value // 4}: {exc.strerror or exc}") from None
    log.info("set conntrack hashsize = %d", value // 4)
    changed.append(f"hashsize={value // 4}")
    return changed


def setup_conntrack(c: ConntrackConfig, host: Host | None = None) -> list[str]:
    """setupConntrack: what was changed ("name=value"); SysctlError on the first failure."""
    host = host or Host()
    changed: list[str] = []
    maximum = conntrack_max(c, host.cpus())
    if maximum > 0:
        changed += set_max(host, maximum)
    for name, value in (("nf_conntrack_tcp_timeout_established", c.tcp_established_timeout),
                        ("nf_conntrack_tcp_timeout_close_wait", c.tcp_close_wait_timeout),
                        ("nf_conntrack_tcp_be_liberal", 1 if c.tcp_be_liberal else 0),
                        ("nf_conntrack_udp_timeout", c.udp_timeout),
                        ("nf_conntrack_udp_timeout_stream", c.udp_stream_timeout)):
        if value > 0 and set_sysctl(host, "net/netfilter/" + name, value):
            changed.append(f"net/netfilter/{name}={value}")
    return changed


def strict_arp(host: Host | None = None) -> list[str]:
    """ipvs strictARP: answer ARP only for addresses on the asking interface (MetalLB, kube-vip)."""
    host = host or Host()
    return [f"{n}={v}" for n, v in (("net/ipv4/conf/all/arp_ignore", 1), ("net/ipv4/conf/all/arp_announce", 2))
            if set_sysctl(host, n, v)]


def set_oom_score_adj(value: int, host: Host | None = None) -> bool:
    host = host or Host()
    try:
        with open(host.oom_score_adj, "w") as fh:
            fh.write(f"{value}\n")
    except OSError as exc:
        log.debug("cannot set oom_score_adj to %d: %s", value, exc.strerror or exc)
        return False
    return True


def host_setup(cfg: Config, host: Host | None = None) -> list[str]:
    """Everything kube-proxy sets on the host at start for this configuration; SysctlError if fatal."""
    host = host or Host()
    px = cfg.proxy
    changed: list[str] = []
    if px.oom_score_adj is not None and set_oom_score_adj(px.oom_score_adj, host):
        changed.append(f"oom_score_adj={px.oom_score_adj}")
    if px.conntrack is not None:
        try:
            changed += setup_conntrack(px.conntrack, host)
        except SysctlError as exc:
            hint = (" (conntrack.maxPerCore: 0 or --conntrack-max-per-core=0 leaves nf_conntrack_max alone)"
                    if "nf_conntrack_max" in str(exc) else "")
            raise SysctlError(f"conntrack: {exc}{hint}") from None
    if px.proxy_mode == "ipvs" and px.ipvs_strict_arp:
        changed += strict_arp(host)
    return changed
