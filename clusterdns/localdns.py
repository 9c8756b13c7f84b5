"""Local DNS addresses on the node, NodeLocal DNSCache style, without its second hop.

The agent holds each --local-ip (e.g. the kube-dns ClusterIP 172.20.0.10 and
169.254.20.10) on a device named `nodelocaldns` and answers DNS there itself.
A `dummy` link is preferred; kernels without the dummy driver get a bridge
with no ports, which holds local addresses just as well.

Rules, in chains clusterdns owns and jumped to first:
- raw PREROUTING/OUTPUT -> CLUSTERDNS-NOTRACK: UDP/TCP port 53 to and from the
  local IPs is NOTRACK. Untracked packets skip the nat hooks, so the proxier's
  DNAT of the kube-dns ClusterIP never applies, and conntrack (its races and
  the 5-second lookups they cause) is never involved.
- filter INPUT/OUTPUT -> CLUSTERDNS-LOCAL: ACCEPT port 53 to/from the local
  IPs, ahead of any firewall or the proxier's REJECT for a Service without
  endpoints. (The proxier's REJECTs match only conntrack state NEW, which
  untracked packets never have; the ACCEPT keeps that true for any firewall.)
The rules are re-checked periodically and after each proxier sync (which may
insert its own jumps above ours), and removed by `cleanup()`.

Failures are counted in NodeLocal DNSCache's coredns_nodecache_setup_errors_total
{errortype}: interface_add (the device or an address could not be set up),
interface_check (the device could not be read), iptables, iptables_lock (the
xtables lock stayed held past `-w 5`).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Iterable

from .metrics import nodecache_setup_errors
from .proxy.apply import ApplyError, CommandRunner, IptablesExecutor, Result, SubprocessRunner

log = logging.getLogger(__name__)

DEVICE = "nodelocaldns"
NOTRACK_CHAIN = "CLUSTERDNS-NOTRACK"
ACCEPT_CHAIN = "CLUSTERDNS-LOCAL"
COMMENT = "clusterdns local DNS"
# (table, built-in chain, our chain): the jumps we own.
JUMPS = (("raw", "PREROUTING", NOTRACK_CHAIN), ("raw", "OUTPUT", NOTRACK_CHAIN),
         ("filter", "INPUT", ACCEPT_CHAIN), ("filter", "OUTPUT", ACCEPT_CHAIN))


class LocalDNSError(RuntimeError):
    """The device, an address or the rules could not be set up."""


def _setup_error(errortype: str, message: str) -> None:
    if errortype == "iptables" and "xtables lock" in message:
        errortype = "iptables_lock"
    nodecache_setup_errors.labels(errortype).inc()


def split_families(ips: Iterable[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {4: [], 6: []}
    for ip in ips:
        addr = ipaddress.ip_address(ip)
        out[addr.version].append(str(addr))
    return out


def render_rules(ips: Iterable[str], family: int, port: int = 53) -> str:
    """iptables-restore text (for --noflush) filling our two chains for one family.

    Declaring a chain in a --noflush restore flushes it, so the text replaces
    the chains' whole content atomically and is safe to apply again.
    """
    plen = 32 if family == 4 else 128
    raw, flt = [], []
    for ip in ips:
        for proto in ("udp", "tcp"):
            to = f"-d {ip}/{plen} -p {proto} -m {proto} --dport {port}"
            back = f"-s {ip}/{plen} -p {proto} -m {proto} --sport {port}"
            for match in (to, back):
                raw.append(f'-A {NOTRACK_CHAIN} {match} -m comment --comment "{COMMENT}" -j NOTRACK')
                flt.append(f'-A {ACCEPT_CHAIN} {match} -m comment --comment "{COMMENT}" -j ACCEPT')
    return "\n".join(["*raw", f":{NOTRACK_CHAIN} - [0:0]", *raw, "COMMIT",
                      "*filter", f":{ACCEPT_CHAIN} - [0:0]", *flt, "COMMIT", ""])


class LocalDNS:
    """Owns the nodelocaldns device, its addresses and the NOTRACK/ACCEPT rules."""

    def __init__(self, ips: Iterable[str], runner: CommandRunner | None = None, port: int = 53,
                 check_interval: float = 10.0, backend: str | None = None) -> None:
        self.ips = list(dict.fromkeys(ips))
        self.families = split_families(self.ips)
        self.runner = runner or SubprocessRunner()
        self.port = port
        self.check_interval = check_interval
        self.link_type = ""
        self.repairs = 0
        self._ipt = {f: IptablesExecutor(self.runner, f, backend) for f in (4, 6)}
        self._lock = asyncio.Lock()

    async def _run(self, *argv: str, stdin: str | None = None, check: bool = True) -> Result:
        res = await self.runner.run(argv, stdin)
        if check and res.returncode != 0:
            raise LocalDNSError(f"{' '.join(argv)}: {(res.stderr or res.stdout).strip() or res.returncode}")
        return res

    # -- device and addresses
    async def ensure_device(self) -> None:
        try:
            await self._ensure_device()
        except LocalDNSError as exc:
            _setup_error("interface_add", str(exc))
            raise

    async def _ensure_device(self) -> None:
        res = await self._run("ip", "-d", "-o", "link", "show", "dev", DEVICE, check=False)
        if res.returncode != 0:
            res = await self._run("ip", "link", "add", DEVICE, "type", "dummy", check=False)
            if res.returncode == 0:
                self.link_type = "dummy"
            else:
                # This kernel has no dummy driver: a bridge without ports holds addresses too.
                log.info("no dummy link type (%s); using a bridge for %s", res.stderr.strip(), DEVICE)
                await self._run("ip", "link", "add", DEVICE, "type", "bridge")
                self.link_type = "bridge"
        else:
            self.link_type = "dummy" if " dummy " in res.stdout else "bridge" if " bridge " in res.stdout else "other"
        await self._run("ip", "link", "set", DEVICE, "up")
        for ip in self.families[4]:
            await self._run("ip", "-4", "addr", "replace", f"{ip}/32", "dev", DEVICE)
        for ip in self.families[6]:
            await self._run("ip", "-6", "addr", "replace", f"{ip}/128", "dev", DEVICE, "nodad")

    async def addresses_present(self) -> bool:
        res = await self._run("ip", "-o", "addr", "show", "dev", DEVICE, check=False)
        if res.returncode != 0:
            err = (res.stderr or res.stdout).strip()
            if "does not exist" not in err and "Cannot find device" not in err:
                _setup_error("interface_check", err)
            return False
        have = set()
        for line in res.stdout.splitlines():
            words = line.split()
            for i, w in enumerate(words):
                if w in ("inet", "inet6") and i + 1 < len(words):
                    have.add(str(ipaddress.ip_address(words[i + 1].split("/")[0])))
        return set(self.ips) <= have

    # -- rules
    def _tool(self, family: int, suffix: str = "") -> str:
        ipt = self._ipt[family]
        base = "iptables" if family == 4 else "ip6tables"
        return f"{base}-{ipt.backend}" + (f"-{suffix}" if suffix else "")

    async def _jumps_first(self, family: int) -> bool:
        """True when each of our jumps is the first rule of its built-in chain."""
        for table, chain, target in JUMPS:
            res = await self._run(self._tool(family), "-w", "5", "-t", table, "-S", chain, check=False)
            rules = [line for line in res.stdout.splitlines() if line.startswith("-A ")]
            if res.returncode != 0 or not rules or not rules[0].endswith(f"-j {target}"):
                return False
        return True

    async def _chains_current(self, family: int) -> bool:
        want = [line for line in render_rules(self.families[family], family, self.port).splitlines()
                if line.startswith("-A ")]
        for table, chain in (("raw", NOTRACK_CHAIN), ("filter", ACCEPT_CHAIN)):
            res = await self._run(self._tool(family), "-w", "5", "-t", table, "-S", chain, check=False)
            if res.returncode != 0:
                return False
            have = [line for line in res.stdout.splitlines() if line.startswith("-A ")]
            if not _same([r for r in want if r.startswith(f"-A {chain} ")], have):
                return False
        return True

    async def _install(self, family: int) -> None:
        await self._ipt[family].detect_backend()
        try:
            await self._ipt[family].restore(render_rules(self.families[family], family, self.port))
            for table, chain, target in JUMPS:
                await self._delete_jumps(family, table, chain, target)
                await self._run(self._tool(family), "-w", "5", "-t", table, "-I", chain, "1",
                                "-m", "comment", "--comment", COMMENT, "-j", target)
        except (ApplyError, LocalDNSError) as exc:
            _setup_error("iptables", str(exc))
            raise LocalDNSError(str(exc)) from None

    async def _delete_jumps(self, family: int, table: str, chain: str, target: str) -> None:
        for _ in range(32):  # bounded: a rule we cannot delete must not spin forever
            res = await self._run(self._tool(family), "-w", "5", "-t", table, "-D", chain,
                                  "-m", "comment", "--comment", COMMENT, "-j", target, check=False)
            if res.returncode != 0:
                res = await self._run(self._tool(family), "-w", "5", "-t", table, "-D", chain,
                                      "-j", target, check=False)
            if res.returncode != 0:
                return

    async def setup(self) -> None:
        """Device, addresses and rules, from scratch or repairing what is there."""
        async with self._lock:
            await self.ensure_device()
            for family in (4, 6):
                if self.families[family]:
                    await self._install(family)
        log.info("local DNS addresses %s on %s (%s)", ", ".join(self.ips), DEVICE, self.link_type)

    async def check(self) -> bool:
        """Re-check everything; repair and return True when something was missing."""
        async with self._lock:
            repaired = False
            if not await self.addresses_present():
                log.warning("local DNS addresses missing on %s; restoring", DEVICE)
                await self.ensure_device()
                repaired = True
            for family in (4, 6):
                if not self.families[family]:
                    continue
                await self._ipt[family].detect_backend()
                if not (await self._chains_current(family) and await self._jumps_first(family)):
                    log.warning("local DNS rules (IPv%d) missing or not first; restoring", family)
                    await self._install(family)
                    repaired = True
            self.repairs += repaired
            return repaired

    async def run(self) -> None:
        """Re-check periodically until cancelled; errors are logged and retried."""
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.check()
            except LocalDNSError as exc:
                log.error("local DNS check failed: %s", exc)

    async def cleanup(self, remove_device: bool = True) -> None:
        await cleanup(self.runner, remove_device=remove_device)


def _same(want: list[str], have: list[str]) -> bool:
    """Our chain as `iptables -S` prints it equals what we wrote. Compared as token
    sets per rule, as a backend may print /32 or reorder matches."""
    def key(rule: str) -> frozenset:
        return frozenset(rule.replace('"', "").replace("/32", "").replace("/128", "").split())
    return len(want) == len(have) and {key(r) for r in want} == {key(r) for r in have}


async def cleanup(runner: CommandRunner | None = None, remove_device: bool = True) -> list[str]:
    """Remove every local-DNS rule, chain and (optionally) the device; returns what was removed.

    Safe to call when nothing is installed. Used by `clusterdns proxy --cleanup`.
    """
    runner = runner or SubprocessRunner()
    removed: list[str] = []
    for family in (4, 6):
        ipt = IptablesExecutor(runner, family)
        await ipt.detect_backend()
        tool = f"{'iptables' if family == 4 else 'ip6tables'}-{ipt.backend}"
        for table, chain, target in JUMPS:
            for _ in range(32):
                res = await runner.run([tool, "-w", "5", "-t", table, "-D", chain,
                                        "-m", "comment", "--comment", COMMENT, "-j", target])
                if res.returncode != 0:
                    res = await runner.run([tool, "-w", "5", "-t", table, "-D", chain, "-j", target])
                if res.returncode != 0:
                    break
                removed.append(f"IPv{family} {table} {chain} -j {target}")
        for table, chain in (("raw", NOTRACK_CHAIN), ("filter", ACCEPT_CHAIN)):
            if (await runner.run([tool, "-w", "5", "-t", table, "-F", chain])).returncode == 0:
                await runner.run([tool, "-w", "5", "-t", table, "-X", chain])
                removed.append(f"IPv{family} {table} {chain}")
    if remove_device:
        if (await runner.run(["ip", "link", "del", DEVICE])).returncode == 0:
            removed.append(f"device {DEVICE}")
    return removed


__all__ = ["DEVICE", "LocalDNS", "LocalDNSError", "cleanup", "render_rules", "split_families"]
