"""Executors: the only place the proxier touches the kernel.

Every tool runs through a CommandRunner (`async run(argv, stdin) -> Result`):
SubprocessRunner for real (asyncio subprocesses, so the event loop keeps
serving DNS while a large restore runs) and RecordingRunner for unit tests
(records each command, answers from a script). The mode executors on top
(IptablesExecutor, NftExecutor, IpvsExecutor) speak one tool each and raise
ApplyError carrying the tool's own stderr when it refuses the input.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Protocol

from . import iptsave

log = logging.getLogger(__name__)

CANARY = "KUBE-PROXY-CANARY"
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
# Chains declared in one table from which a full restore on iptables-nft gets the `-S` line
# (see whole_table_cache); below it the sorted list costs nothing worth a listing.
WHOLE_TABLE_FROM = 256
CANARY_TABLES = ("mangle", "nat", "filter")
NFT_TABLE = "kube-proxy"


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""


class ApplyError(RuntimeError):
    """A tool refused its input or could not run; the message holds its stderr."""

    def __init__(self, result: Result) -> None:
        self.result = result
        tool = result.argv[0] if result.argv else "?"
        detail = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
        super().__init__(f"{tool} failed (exit {result.returncode}): {detail}")


class CommandRunner(Protocol):
    async def run(self, argv: Iterable[str], stdin: str | None = None) -> Result: ...


class SubprocessRunner:
    """Runs tools as child processes; `prefix` wraps every command (e.g. `ip netns exec NS`)."""

    def __init__(self, prefix: Iterable[str] = (), timeout: float = 600.0) -> None:
        self.prefix = tuple(prefix)
        self.timeout = timeout

    async def run(self, argv: Iterable[str], stdin: str | None = None) -> Result:
        argv = tuple(argv)
        full = self.prefix + argv
        try:
            proc = await asyncio.create_subprocess_exec(
                *full, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:  # missing binary: report it like a tool failure
            return Result(argv, 127, "", f"cannot run {argv[0]}: {exc.strerror or exc}")
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self.timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return Result(argv, -9, "", f"{argv[0]} timed out after {self.timeout:g}s")
        return Result(argv, proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


@dataclass
class RecordingRunner:
    """A fake runner for unit tests: records (argv, stdin) and answers from `respond`.

    `respond(argv, stdin)` returns a Result, or None for success with no output.
    """
    respond: Callable[[tuple[str, ...], str | None], Result | None] | None = None
    calls: list[tuple[tuple[str, ...], str | None]] = field(default_factory=list)

    async def run(self, argv: Iterable[str], stdin: str | None = None) -> Result:
        argv = tuple(argv)
        self.calls.append((argv, stdin))
        res = self.respond(argv, stdin) if self.respond else None
        return res if res is not None else Result(argv, 0)

    def commands(self) -> list[str]:
        return [" ".join(a) for a, _ in self.calls]


def _check(res: Result) -> Result:
    if res.returncode != 0:
        raise ApplyError(res)
    return res


# partial iptables texts shorter than this go in from the agent's own process (a few hundred
# lines in a sync of a changed Service; a 5,000-endpoint Service's chain is ~1 MB)
PARTIAL_IN_PROCESS = 4 << 20


def netlink_netns(runner: CommandRunner) -> "str | None | Literal[False]":
    """Where netlink batches may go for this runner: None (this process's namespace), a
    namespace name (a runner prefixed `ip netns exec NAME`), or False (a fake or other
    runner: never touch the kernel behind its back)."""
    if not isinstance(runner, SubprocessRunner):
        return False
    p = runner.prefix
    if not p:
        return None
    if len(p) == 4 and p[:3] == ("ip", "netns", "exec"):
        return p[3]
    return False


# ---------------------------------------------------------------- iptables

def whole_table_cache(text: str, min_chains: int = WHOLE_TABLE_FROM) -> str:
    """`text` for `iptables-nft-restore --noflush` with a `-S` line early in each table
    that declares at least `min_chains` chains: the same kernel result in linear time.

    Why: with --noflush, iptables-nft 1.8.x keeps the chains its cache must fetch in a
    sorted linked list, one insertion per command (nft-cache.c cache_chain_list_insert),
    quadratic in the chains of a table: 4,000 Services take minutes. A command that names
    no chain (only -S, -L, -Z, -F and -X can, and only listing is read-only) makes it fetch
    the whole table instead and skip the list; the -S prints to stdout when it runs, which
    the caller discards. It runs where it stands, and a listing fills the cache with fake
    entries for base chains missing from the kernel, so every command on a base chain (the
    jumps of a first sync) and the declarations of the chains they jump to come before it;
    their order among themselves, and everyone else's, is kept. A table whose declarations
    do not all come before its other commands is left as it is (moving them would change
    what it does). String and regex work only: the text is 430,000 lines at scale."""
    out: list[str] = []
    pos = 0
    while pos < len(text):
        end = text.find("\nCOMMIT\n", pos)
        if end < 0:
            out.append(text[pos:])
            break
        out.append(_with_listing(text[pos:end + 1], min_chains))
        out.append("COMMIT\n")
        pos = end + 8
    return "".join(out)


_NOT_DECL = re.compile(r"\n[^:]")
# a command on a base chain, with the newline before it (a leading "\n" anchors faster than ^ with re.M)
_BASE_LINE = re.compile(r"\n-[A-Z] (?:%s)(?: [^\n]*)?(?![^\n])" % "|".join(sorted(BUILTIN_CHAINS)))


def _with_listing(section: str, min_chains: int) -> str:
    """One table's part of a restore text (from its *table line to the newline before COMMIT)."""
    first = section.find("\n")
    if not section.startswith("*") or first < 0:
        return section
    m = _NOT_DECL.search(section, first)
    decl_end = m.start() if m else len(section) - 1    # at the newline ending the last declaration
    if section.count("\n:", first, decl_end) < min_chains or section.find("\n:", decl_end) >= 0:
        return section
    decls, body = section[first:decl_end], section[decl_end:]   # each starts with its "\n"
    base = _BASE_LINE.findall(body)
    if base:
        body = _BASE_LINE.sub("", body)
    names = set(BUILTIN_CHAINS) | {iptsave.target(line.split(" ", 2)[2]) for line in base if line.count(" ") >= 2}
    names.discard("")
    pick = re.compile(r"\n:(?:%s) [^\n]*(?![^\n])" % "|".join(re.escape(c) for c in sorted(names)))
    early = pick.findall(decls)
    if early:
        decls = pick.sub("", decls)
    return section[:first] + "".join(early) + "".join(base) + "\n-S" + decls + body


class IptablesExecutor:
    """iptables-restore / iptables-save for one family and one backend (nft or legacy)."""

    def __init__(self, runner: CommandRunner, family: int = 4, backend: str | None = None) -> None:
        self.runner = runner
        self.family = family
        self.backend = backend   # None: detect on first use
        self._detection_dump: str | None = None
        # full texts on iptables-nft go in through whole_table_cache (off: plain --noflush, for
        # comparing the two)
        self.list_tables = True
        # ... or, where the runner allows, as one nfnetlink batch of the objects iptables-nft
        # would make (proxy/iptnl.py; off: the tool)
        self.netlink = True
        self.last_path = ""          # how the last restore went in: "netlink" or the tool
        # (table, chain) a full text deletes that the kernel kept, still referenced by
        # another component's rule (the netlink path goes on without deleting them)
        self.kept: list[tuple[str, str]] = []

    def tool(self, name: str) -> str:
        base = "iptables" if self.family == 4 else "ip6tables"
        return f"{base}-{self.backend}-{name}" if name else f"{base}-{self.backend}"

    async def detect_backend(self, keep_dump: bool = False) -> str:
        """Pick the backend the host uses, as kubernetes-sigs/iptables-wrappers does:
        the one holding more rules; nft when tied or when legacy is missing.

        keep_dump: keep the chosen backend's dump for take_detection_dump()."""
        if self.backend:
            return self.backend
        counts = {}
        dumps: dict[str, str] = {}
        for backend in ("legacy", "nft"):
            tool = f"{'iptables' if self.family == 4 else 'ip6tables'}-{backend}-save"
            if shutil.which(tool) is None and not isinstance(self.runner, RecordingRunner):
                counts[backend] = -1
                continue
            if backend == "nft" and counts["legacy"] <= 0 and self._nf_tables_answers():
                # legacy holds nothing, so nft wins whatever it holds: no dump of every
                # nf_tables rule (iptables-nft-save takes ~7 s at 10,000 Services x 10)
                counts[backend] = 0
                break
            res = await self.runner.run([tool])
            counts[backend] = iptsave.count_rules(res.stdout) if res.returncode == 0 else -1
            dumps[backend] = res.stdout if res.returncode == 0 else ""
        self.backend = "legacy" if counts["legacy"] > counts["nft"] else "nft"
        self._detection_dump = dumps.get(self.backend) if keep_dump else None
        log.info("iptables backend: %s (rules: legacy %d, nft %s)", self.backend, counts["legacy"],
                 counts["nft"] if "nft" in dumps or counts["nft"] < 0 else "not counted")
        return self.backend

    def _nf_tables_answers(self) -> bool:
        """The runner's kernel answers an nf_tables request (one dump of table names)."""
        netns = netlink_netns(self.runner)
        if netns is False:
            return False
        from . import nflink
        try:
            nflink.table_names(self.family, netns=netns)
        except (nflink.NflinkError, OSError):
            return False
        return True

    def take_detection_dump(self) -> str | None:
        """The whole dump of the chosen backend read while detecting it (once; None after,
        or when the backend was given): the start reads it instead of a second dump."""
        dump, self._detection_dump = self._detection_dump, None
        return dump

    async def restore(self, text: str, full: bool = False, listed: bool = False) -> None:
        """One atomic (per table) `iptables-restore --noflush --counters` call.

        full: a text declaring every chain of ours (a full sync, a cleanup): on the nf_tables
        backend it goes in through whole_table_cache. listed: the text already lists the big
        tables that way (iptables.render(listing=True)). A listing's output goes to /dev/null."""
        await self.detect_backend()
        netns = netlink_netns(self.runner)
        if not full and self.backend == "nft" and self.netlink and netns is not False \
                and len(text) < PARTIAL_IN_PROCESS:
            # a partial text: in this process (a thread), one small batch; the tool's --noflush
            # would first fetch the chains it names from a kernel holding 110,000 at scale
            from . import iptnl
            stats: dict = {}
            try:
                kept = await asyncio.to_thread(iptnl.apply, text, self.family, netns=netns, stats=stats,
                                               early_bytes=0)
            except iptnl.Unsupported as exc:
                log.debug("iptables IPv%d: %s; restoring with the tool", self.family, exc)
            except (iptnl.NflinkError, OSError) as exc:
                raise ApplyError(Result(("nfnetlink",), 1, "", str(exc))) from None
            else:
                self.kept = kept
                self.last_path = "netlink"
                log.debug("iptables IPv%d partial restore over netlink: %s", self.family, stats)
                return
        if full and self.backend == "nft" and self.netlink and isinstance(self.runner, SubprocessRunner):
            # iptnl in a child process run like the tool (prefix and all): see iptnl.main
            from . import iptnl
            res = await self.runner.run([sys.executable, "-m", "clusterdns.proxy.iptnl",
                                         "--family", str(self.family)], text)
            if res.returncode == 0:
                try:
                    out = json.loads(res.stdout)
                except ValueError:
                    out = {}
                self.kept = [(str(k[0]), str(k[1])) for k in out.get("kept", ())]
                self.last_path = "netlink"
                log.debug("iptables IPv%d full restore over netlink: %s", self.family, out.get("stats"))
                if self.kept:
                    log.warning("iptables IPv%d: %s still referenced by other components' rules (or already "
                                "gone): kept, flushed; the rest of the full sync went in", self.family,
                                ", ".join(f"{t}/{c}" for t, c in self.kept))
                return
            if res.returncode != iptnl.EXIT_UNSUPPORTED:
                raise ApplyError(Result(("nfnetlink",), res.returncode, "", res.stderr))
            log.debug("iptables IPv%d: %s; restoring with the tool", self.family, res.stderr.strip())
        self.last_path = self.tool("restore")
        argv = [self.tool("restore"), "-w", "5", "--noflush", "--counters"]
        if full and self.backend == "nft" and self.list_tables and not listed:
            # (in a thread: 430,000 lines at 10,000 Services, while the event loop answers DNS)
            changed = await asyncio.to_thread(whole_table_cache, text)
            listed = changed != text
            text = changed
        if listed and isinstance(self.runner, SubprocessRunner):
            # the listing can be the whole table (300,000 lines at scale): not into memory
            argv = ["sh", "-c", 'exec "$0" "$@" >/dev/null', *argv]
        _check(await self.runner.run(argv, text))

    async def save(self, table: str) -> str:
        await self.detect_backend()
        res = await self.runner.run([self.tool("save"), "-t", table])
        if res.returncode != 0 and "does not exist" in res.stderr.lower():
            return ""
        return _check(res).stdout

    async def save_all(self) -> str:
        """iptables-save of every table (cleanup reads the jumps from it)."""
        await self.detect_backend()
        return _check(await self.runner.run([self.tool("save")])).stdout

    async def insert(self, table: str, chain: str, spec: str) -> None:
        """`iptables -I CHAIN spec` unless `-C` finds the rule already there."""
        import shlex
        await self.detect_backend()
        args = shlex.split(spec)
        res = await self.runner.run([self.tool(""), "-w", "5", "-t", table, "-C", chain, *args])
        if res.returncode != 0:
            _check(await self.runner.run([self.tool(""), "-w", "5", "-t", table, "-I", chain, *args]))

    async def existing_chains(self, tables: Iterable[str] = ("nat", "filter")) -> dict[str, set[str]]:
        """The KUBE-* chains in the kernel now, per table."""
        out: dict[str, set[str]] = {}
        for table in tables:
            out[table] = iptsave.chains(await self.save(table), "KUBE-").get(table, set())
        return out

    async def canary_exists(self, table: str = "mangle") -> bool:
        await self.detect_backend()
        res = await self.runner.run([self.tool(""), "-w", "5", "-t", table, "-S", CANARY])
        return res.returncode == 0

    async def ensure_canary(self) -> None:
        """The empty KUBE-PROXY-CANARY chains whose absence means someone flushed the tables."""
        text = "".join(f"*{t}\n:{CANARY} - [0:0]\nCOMMIT\n" for t in CANARY_TABLES)
        await self.restore(text)


# ---------------------------------------------------------------- nftables

class NftExecutor:
    """`nft -f -`: one transaction per call, text on stdin."""

    def __init__(self, runner: CommandRunner, family: int = 4) -> None:
        self.runner = runner
        self.family = family

    @property
    def nft_family(self) -> str:
        return "ip" if self.family == 4 else "ip6"

    async def apply(self, text: str) -> None:
        _check(await self.runner.run(["nft", "-f", "-"], text))

    @property
    def netlink_netns(self) -> "str | None | Literal[False]":
        return netlink_netns(self.runner)

    async def apply_small(self, text: str | Callable[[], str], ops=()) -> str:
        """An incremental transaction: over nfnetlink when every operation (`ops`, the
        nftobj.Op the text was encoded from) is one proxy/nflink encodes (nft 1.0.6
        loads the whole ruleset before any `nft -f`, seconds at 10,000 Services),
        else `nft -f` of the text. `text` may be a function that makes it: it is then
        made only for that fallback. Returns the path used."""
        return await self._apply_ops(text, ops, full=False)

    async def apply_full(self, text: str | Callable[[], str], ops=()) -> str:
        """A full transaction (the whole table): one nfnetlink batch encoded from `ops` when
        nflink encodes every operation (no nft process, no cache of the old table), else
        `nft -f` of the text. Returns the path used."""
        return await self._apply_ops(text, ops, full=True)

    async def _apply_ops(self, text: str | Callable[[], str], ops, full: bool) -> str:
        netns = self.netlink_netns
        if ops and netns is not False:
            from . import nflink
            # No supported() check first: at 10,000 Services encoding the batch takes over a
            # second, and in the event loop it held up every DNS answer that needs the loop.
            # apply() encodes in the worker thread and raises Unsupported before sending.
            try:
                await asyncio.to_thread(nflink.apply, ops, self.family, netns=netns, full=full)
                return "netlink"
            except nflink.Unsupported:
                pass
            except (nflink.NflinkError, OSError) as exc:
                raise ApplyError(Result(("nfnetlink",), 1, "", f"{exc}")) from None
        await self.apply(text if isinstance(text, str) else await asyncio.to_thread(text))
        return "nft"

    async def table_exists(self, table: str = NFT_TABLE, probe: str = "cluster-ips") -> bool:
        """Whether our table is there, by listing one small set of it.

        `nft list tables` loads the whole ruleset cache (~0.25 s with 1,000
        services here); listing the ClusterIP set costs ~10 ms."""
        res = await self.runner.run(["nft", "list", "set", self.nft_family, table, probe])
        return res.returncode == 0

    async def table_listed(self, table: str = NFT_TABLE) -> bool:
        """Whether the family's tables include ours (thorough; for cleanup, not per sync).

        Over netlink, tables only, where the runner allows: `nft list tables` (the fallback)
        loads the whole ruleset first, over two minutes with iptables-nft's rules for 10,000
        Services, and the agent's first full sync waited on it before DNS answered."""
        netns = self.netlink_netns
        if netns is not False:
            from . import nflink
            try:
                return table in await asyncio.to_thread(nflink.table_names, self.family, netns=netns)
            except (nflink.NflinkError, OSError) as exc:
                log.debug("netlink table listing failed (%s); asking nft", exc)
        res = await self.runner.run(["nft", "list", "tables", self.nft_family])
        return res.returncode == 0 and any(
            line.split()[-1:] == [table] for line in res.stdout.splitlines())


# ---------------------------------------------------------------- IPVS

IPVS_DEVICE = "kube-ipvs0"


def _ipvs_table(text: str) -> dict[tuple[str, str], tuple[str, dict[str, str]]]:
    """{(proto flag, VIP:port): (service line, {real server: real line})} from
    ipvsadm-restore input or `ipvsadm -S -n` output."""
    out: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] not in ("-A", "-a"):
            continue
        key = (parts[1], parts[2])
        if parts[0] == "-A":
            out[key] = (" ".join(parts), out.get(key, ("", {}))[1])
        elif "-r" in parts:
            real = parts[parts.index("-r") + 1]
            out.setdefault(key, ("", {}))[1][real] = " ".join(parts)
    return out


def ipvs_diff(current: str, desired: str, ours: set[str] | None = None, exclude: tuple[str, ...] = ()) -> str:
    """ipvsadm-restore input turning `current` into `desired`, touching only
    virtual servers in `desired` or on addresses in `ours` (kube-ipvs0's), and
    never deleting one on an address in `exclude` (kube-proxy's ipvs.excludeCIDRs).

    ipvsadm-restore only adds, so re-applying a whole table fails on the
    first existing service; this edits in place instead (-E/-e keep the
    connections of services that stay)."""
    have, want = _ipvs_table(current), _ipvs_table(desired)
    ours = ours or set()
    nets = [ipaddress.ip_network(c, strict=False) for c in exclude]
    out: list[str] = []
    for key, (_, reals) in have.items():
        addr = key[1].rsplit(":", 1)[0].strip("[]")
        if key not in want and addr in ours and not any(ipaddress.ip_address(addr) in n for n in nets):
            out.append(f"-D {key[0]} {key[1]}")
    for key, (svc_line, reals) in want.items():
        if key not in have:
            out.append(svc_line)
            out += list(reals.values())
            continue
        old_line, old_reals = have[key]
        if svc_line.split() != old_line.split():
            out.append("-E" + svc_line[2:])
        for real in old_reals.keys() - reals.keys():
            out.append(f"-d {key[0]} {key[1]} -r {real}")
        for real, line in reals.items():
            if real not in old_reals:
                out.append(line)
            elif line.split() != old_reals[real].split():
                out.append("-e" + line[2:])
    return "".join(line + "\n" for line in out)


def drop_present_inserts(text: str, save_text: str) -> str:
    """Remove `-I CHAIN spec` lines whose rule `-A CHAIN spec` is already in iptables-save output,
    so re-applying a text that inserts jumps never duplicates them."""
    present = {(t, f"{c} {sp}") for t, c, sp in iptsave.present(save_text)}
    out, table = [], ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        if line.startswith("-I ") and (table, line[3:]) in present:
            continue
        out.append(line)
    return "\n".join(out) + "\n"


class IpvsExecutor:
    """Applies an ipvs.IpvsConfig: the kube-ipvs0 device and its addresses, ipsets,
    IPVS virtual/real servers (ipvsadm-restore) and the few iptables rules.

    Needs the ip_vs kernel module, which this development machine lacks."""

    def __init__(self, runner: CommandRunner, family: int = 4, iptables: IptablesExecutor | None = None) -> None:
        self.runner = runner
        self.family = family
        self.iptables = iptables or IptablesExecutor(runner, family)

    async def ensure_device(self, addresses: Iterable[str]) -> None:
        res = await self.runner.run(["ip", "link", "show", IPVS_DEVICE])
        if res.returncode != 0:
            # A bridge without ports where the dummy type is missing holds addresses just as well.
            res = await self.runner.run(["ip", "link", "add", IPVS_DEVICE, "type", "dummy"])
            if res.returncode != 0:
                _check(await self.runner.run(["ip", "link", "add", IPVS_DEVICE, "type", "bridge"]))
        _check(await self.runner.run(["ip", "link", "set", IPVS_DEVICE, "up"]))
        want = set(addresses)
        fam = "-4" if self.family == 4 else "-6"
        res = _check(await self.runner.run(["ip", fam, "-o", "addr", "show", "dev", IPVS_DEVICE]))
        have = {tok.split("/")[0] for line in res.stdout.splitlines()
                for i, tok in enumerate(line.split()) if i > 0 and line.split()[i - 1] in ("inet", "inet6")}
        plen = "32" if self.family == 4 else "128"
        for ip in sorted(want - have):
            _check(await self.runner.run(["ip", "addr", "add", f"{ip}/{plen}", "dev", IPVS_DEVICE]))
        for ip in sorted(have - want):
            await self.runner.run(["ip", "addr", "del", f"{ip}/{plen}", "dev", IPVS_DEVICE])

    async def apply(self, config, exclude: tuple[str, ...] = ()) -> None:
        """config: an ipvs.IpvsConfig (ipvsadm, ipsets, iptables texts and the addresses);
        exclude: CIDRs whose virtual servers are never deleted.

        Re-applicable: IPVS services are edited in place against `ipvsadm -S -n`,
        and jumps the iptables text inserts are skipped when already there."""
        await self.ensure_device(config.addresses)
        if config.ipsets:
            _check(await self.runner.run(["ipset", "restore", "-exist"], config.ipsets))
        current = _check(await self.runner.run(["ipvsadm", "-S", "-n"])).stdout
        changes = ipvs_diff(current, config.ipvsadm, set(config.addresses), exclude)
        if changes:
            _check(await self.runner.run(["ipvsadm-restore"], changes))
        if config.iptables:
            save = await self.iptables.save("nat") + await self.iptables.save("filter")
            await self.iptables.restore(drop_present_inserts(config.iptables, save))

    async def clear(self) -> None:
        """Remove our IPVS state: virtual servers on kube-ipvs0's addresses, the device, our ipsets."""
        res = await self.runner.run(["ip", "-o", "addr", "show", "dev", IPVS_DEVICE])
        ours = {tok.split("/")[0] for line in res.stdout.splitlines() for tok in line.split()
                if "/" in tok} if res.returncode == 0 else set()
        res = await self.runner.run(["ipvsadm", "-S", "-n"])
        for line in res.stdout.splitlines() if res.returncode == 0 else ():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "-A" and parts[1] in ("-t", "-u", "--sctp-service"):
                addr = parts[2].rsplit(":", 1)[0].strip("[]")
                if addr in ours:
                    await self.runner.run(["ipvsadm", "-D", parts[1], parts[2]])
        await self.runner.run(["ip", "link", "del", IPVS_DEVICE])
        res = await self.runner.run(["ipset", "list", "-n"])
        for name in res.stdout.split() if res.returncode == 0 else ():
            if name.startswith("KUBE-"):
                await self.runner.run(["ipset", "destroy", name])


__all__ = [
    "ApplyError", "CommandRunner", "IptablesExecutor", "IpvsExecutor", "NftExecutor",
    "RecordingRunner", "Result", "SubprocessRunner",
]
