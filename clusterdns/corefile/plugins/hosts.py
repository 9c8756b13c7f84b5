"""CoreDNS's *hosts* plugin: A, AAAA and PTR answers from an /etc/hosts-style file and
lines inlined in the Corefile.

    hosts [FILE [ZONES...]] {
        [INLINE ENTRIES: IP NAME...]
        ttl SECONDS                  (default 3600)
        no_reverse
        reload DURATION              (default 5s, 0 = never)
        fallthrough [ZONES...]
        fallthrough_unsupported
    }

What it answers, as coredns/coredns plugin/hosts does (hosts.go, hosts_test.go):
- a name outside ZONES (default: the block's) goes on, whatever `fallthrough` says,
  except a PTR question, which is looked up wherever it is;
- PTR: the names of that address (file entries first, then inline ones), or the next
  plugin when there are none (again whatever `fallthrough` says);
- A / AAAA of a listed name: its addresses of that family, or NOERROR with no answer
  when it has only the other family; any other type of a listed name: NOERROR, no
  answer (passed on instead with `fallthrough_unsupported` where `fallthrough` covers it);
- a name not listed: the next plugin where `fallthrough` covers it, otherwise SERVFAIL
  (CoreDNS's choice: no SOA to make an NXDOMAIN with).
Names match whatever their letter case; answers carry the lower-cased name, AA set.
A `*.example.com` entry answers for one more label under example.com (not the apex, not
two labels down) where no exact entry exists, and makes no PTR.

The data is an immutable snapshot, replaced whole: the file is re-read (in a worker
thread, never on the event loop) only when its mtime or size changed; a file that
disappears or cannot be read later keeps the last data (logged). At setup a file that
does not exist is a warning, as in CoreDNS (inline entries are served and the file is
picked up when it appears); one that exists but cannot be read, or is not a regular file
(a directory, a FIFO, /dev/zero), is an error.

Deliberate differences: duplicate addresses or names of one entry set are answered
once (an RRset has no duplicates); an inline line that is neither an option nor
`IP NAME...` is refused (CoreDNS drops it silently, which hides typos such as the
old `no-reverse`); names that cannot be DNS names (a label over 63 bytes, non-ASCII)
are skipped in files and refused inline; a relative FILE is read from the Corefile's
directory (CoreDNS: the `root` plugin's, else its working directory).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import dnslib
from prometheus_client.core import GaugeMetricFamily

from ...metrics import DNS as REGISTRY
from ..plugin import Next, Plugin, PluginError, Request, SetupContext, fqdn, match_zone, normalize_zones
from ..syntax import Directive, duration, plugin_error

log = logging.getLogger(__name__)

A, AAAA, PTR = 1, 28, 12
DEFAULT_FILE = "/etc/hosts"
DEFAULT_TTL = 3600
DEFAULT_RELOAD = 5.0
OPTIONS = ("ttl", "no_reverse", "reload", "fallthrough", "fallthrough_unsupported")


# A name's addresses (an address's names) are one str, several joined by spaces (neither
# holds whitespace): strs are not tracked by the garbage collector, so a big file adds no GC
# work. (A list or tuple per entry made the collector walk them all while holding the GIL:
# 0.7 s stalls reloading 1,000,000 lines.) Values of a key that gets many (0.0.0.0 in an
# ad-block list) are gathered in a list while parsing and joined once at the end.
_SHORT = 8


def _values(v: str | None) -> list[str]:
    return [] if v is None else v.split(" ") if " " in v else [v]


# Each table is SHARDS dicts, a key in the one its hash picks: a dict growing past a million
# keys resizes in one call that holds the GIL (0.63 s at 2.8 million keys on the machine
# the figures in the tests came from); 64 smaller ones each resize in a 64th of that.
SHARDS = 64
MASK = SHARDS - 1


def _maps() -> tuple[dict, ...]:
    return tuple({} for _ in range(SHARDS))


@dataclass
class Table:
    """One parsed source (the file, or the inline lines). Built once, then only read."""
    v4: tuple[dict, ...] = field(default_factory=_maps)    # name -> address(es), in file order
    v6: tuple[dict, ...] = field(default_factory=_maps)
    ptr: tuple[dict, ...] = field(default_factory=_maps)   # canonical address -> name(s)
    skipped: int = 0                           # lines or names not usable
    wild: bool = False                         # has `*.` entries
    empty: bool = True                         # no entries at all (most inline tables)

    def __len__(self) -> int:
        return sum(v.count(" ") + 1 for maps in (self.v4, self.v6, self.ptr) for d in maps for v in d.values())

    def get(self, kind: str, key: str) -> str | None:
        return getattr(self, kind)[hash(key) & MASK].get(key)

    def keys(self, kind: str) -> list[str]:
        return [k for d in getattr(self, kind) for k in d]


@dataclass(frozen=True)
class Snapshot:
    """What the plugin answers from: the file's table and the inline one, looked up in
    that order (CoreDNS keeps the two apart and concatenates)."""
    file: Table
    inline: Table

    def owner(self, name: str) -> str | None:
        """The entry that answers for `name`: itself, or the wildcard one label up; None.
        (On the receive threads' path for every name: the common cases look up little.)"""
        f, i = self.file, self.inline
        h = hash(name) & MASK
        if name in f.v4[h] or name in f.v6[h] or not i.empty and (name in i.v4[h] or name in i.v6[h]):
            return name
        if not (f.wild or i.wild):
            return None
        dot = name.find(".")
        if 0 <= dot < len(name) - 1:
            wild = "*" + name[dot:]
            h = hash(wild) & MASK
            if wild in f.v4[h] or wild in f.v6[h] or wild in i.v4[h] or wild in i.v6[h]:
                return wild
        return None

    def addresses(self, owner: str, qtype: int) -> list[str]:
        kind = "v4" if qtype == A else "v6"
        return _unique(self.file.get(kind, owner), self.inline.get(kind, owner))

    def names(self, address: str) -> list[str]:
        return _unique(self.file.get("ptr", address), self.inline.get("ptr", address))


def _unique(a: str | None, b: str | None) -> list[str]:
    if b is None and a is not None and " " not in a:
        return [a]
    return list(dict.fromkeys([*_values(a), *_values(b)]))


_MAPPED = bytes(10) + b"\xff\xff"


def _address(text: str) -> tuple[int, str] | None:
    """(4 or 6, canonical text) of a hosts-file address, or None. An IPv6 zone (`%lo0`) is
    dropped; an IPv4-mapped IPv6 address is IPv4 (Go's To4), as CoreDNS's hosts_test has it.
    inet_pton, like Go's ParseIP, takes no IPv4 octet with a leading zero."""
    if ":" not in text:
        try:
            socket.inet_pton(socket.AF_INET, text)
        except (OSError, ValueError):    # ValueError: a NUL, a lone surrogate
            return None
        return 4, text
    i = text.find("%")
    if i >= 0:
        text = text[:i]
    try:
        packed = socket.inet_pton(socket.AF_INET6, text)
    except (OSError, ValueError):
        return None
    if packed[:12] == _MAPPED:
        return 4, socket.inet_ntop(socket.AF_INET, packed[12:])
    return 6, socket.inet_ntop(socket.AF_INET6, packed)


def valid_name(name: str) -> bool:
    """Can `name` (lower-case FQDN) be put in a reply?"""
    if name == ".":
        return True
    if not name.isascii() or name.startswith(".") or ".." in name:
        return False
    if len(name) > 63:   # only then can a label be too long
        return len(name) <= 254 and all(len(label) <= 63 for label in name.split("."))
    return True


def _add(d: dict, multi: dict, key: str, value: str) -> None:
    have = d.get(key)
    if have is None:
        d[key] = value
    elif key in multi:
        multi[key].append(value)
    elif have.count(" ") < _SHORT:
        d[key] = have + " " + value
    else:
        multi[key] = [have, value]


def parse(lines: Iterable[str], origins: list[str], reverse: bool = True) -> Table:
    """An /etc/hosts text (its lines) as CoreDNS reads it: `#` starts a comment, a line is an
    address and one or more names, lines with a bad address are skipped; names outside
    `origins` too. Lines may come straight from the open file (no one big split)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    t = Table()
    v4, v6, ptr = t.v4, t.v6, t.ptr
    multi: tuple[dict, dict, dict] = ({}, {}, {})   # keys with many values: lists while parsing
    rmany = multi[2]
    everywhere = "." in origins
    seen = _maps()   # address as written -> canonical or None (files repeat 0.0.0.0 ...)
    for line in lines:
        i = line.find("#")
        if i >= 0:
            line = line[:i]
        f = line.split()
        if len(f) < 2:
            continue
        a = f[0]
        memo = seen[hash(a) & MASK]
        if a in memo:
            canon = memo[a]
        else:
            got = _address(a)
            canon = memo[a] = got[1] if got else None   # a str, not a tuple: no GC tracking
        if canon is None:
            t.skipped += 1
            continue
        maps, many = (v6, multi[1]) if ":" in canon else (v4, multi[0])
        back = ptr[hash(canon) & MASK]
        for raw in f[1:]:
            name = raw.lower()
            if not name.endswith("."):
                name += "."
            if not everywhere and match_zone(origins, name) is None:
                continue
            if not valid_name(name):
                t.skipped += 1
                continue
            names = maps[hash(name) & MASK]
            have = names.get(name)       # _add, inlined: this loop runs once per name
            if have is None:
                names[name] = canon
            elif name in many:
                many[name].append(canon)
            elif have.count(" ") < _SHORT:
                names[name] = have + " " + canon
            else:
                many[name] = [have, canon]
            if name[0] != "*":
                if reverse:
                    _add(back, rmany, canon, name)
            elif name[1:2] == ".":
                t.wild = True
    for maps, many in zip((v4, v6, ptr), multi):
        for key, values in many.items():
            maps[hash(key) & MASK][key] = " ".join(values)
    t.empty = not any(v4) and not any(v6)
    return t


def reverse_address(qname: str) -> str | None:
    """The canonical address a reverse name stands for (`4.3.2.1.in-addr.arpa.` -> `1.2.3.4`),
    or None when it is not one whole address (dnsutil.ExtractAddressFromReverse)."""
    if qname.endswith(".in-addr.arpa."):
        labels = qname[:-len(".in-addr.arpa.")].split(".")
        if len(labels) != 4:
            return None
        got = _address(".".join(reversed(labels)))
    elif qname.endswith(".ip6.arpa."):
        labels = qname[:-len(".ip6.arpa.")].split(".")
        if len(labels) != 32 or any(len(x) != 1 for x in labels):
            return None
        nibbles = "".join(reversed(labels))
        got = _address(":".join(nibbles[i:i + 4] for i in range(0, 32, 4)))
    else:
        return None
    return got[1] if got else None


def _read(path: str, origins: list[str], reverse: bool) -> tuple[Table, tuple[int, int]]:
    """The file parsed, and its (mtime_ns, size) as read (fstat of the open file, so they
    agree). Read line by line: no single long call holds the GIL over a big file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not block the open
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(st.st_mode):   # a FIFO, /dev/zero: never read
            raise OSError(errno.EINVAL, "not a regular file")
        fh = open(fd, encoding="utf-8", errors="replace")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        table = parse(fh, origins, reverse)
    return table, (st.st_mtime_ns, st.st_size)


_live: "weakref.WeakSet[Hosts]" = weakref.WeakSet()


class _Collector:
    """CoreDNS's hosts metrics (plugin/hosts/metrics.go), over the plugins serving now."""

    def collect(self):
        plugins = list(_live)
        if not plugins:          # as in CoreDNS: no series without a hosts plugin
            return
        entries = GaugeMetricFamily("coredns_hosts_entries",
                                    "The combined number of entries in hosts and Corefile.", labels=[])
        entries.add_metric([], float(sum(len(p.data.file) + len(p.data.inline) for p in plugins)))
        yield entries
        stamps = [p.reloaded for p in plugins if p.reloaded]
        reload = GaugeMetricFamily("coredns_hosts_reload_timestamp_seconds",
                                   "The timestamp of the last reload of hosts file.")
        reload.add_metric([], max(stamps, default=0.0))
        yield reload


REGISTRY.register(_Collector())


class Hosts(Plugin):
    name = "hosts"

    def __init__(self, *, path: str, origins: list[str], inline: list[str], ttl: int = DEFAULT_TTL,
                 reverse: bool = True, reload: float = DEFAULT_RELOAD, fall: list[str] | None = None,
                 fall_unsupported: bool = False, where: str = "") -> None:
        self.path = path
        self.origins = origins
        self.ttl = ttl
        self.reverse = reverse
        self.reload = reload
        self.fall = fall or []                 # zones fallthrough covers ([] = none)
        self.fall_unsupported = fall_unsupported
        self.where = where
        self.inline_lines = inline
        self._stamp: tuple[int, int] | None = None    # (mtime_ns, size) of the file as last read
        self.reloaded = 0.0                               # that mtime, seconds (CoreDNS's metric)
        self._read_failing = False
        self._task: asyncio.Task | None = None
        inline_table = parse("\n".join(inline), origins, reverse)
        self.data = Snapshot(Table(), inline_table)

    # --- the data ---------------------------------------------------------------------

    def load_initial(self) -> None:
        """Read the file at setup: missing is a warning (CoreDNS), unreadable an error (raised)."""
        try:
            table, stamp = _read(self.path, self.origins, self.reverse)
        except FileNotFoundError:
            log.warning("plugin/hosts: %s: file does not exist (serving inline entries until it appears)",
                        self.path)
            self._read_failing = True     # said once; its return is logged
            return
        self.data = Snapshot(table, self.data.inline)
        self._stamp = stamp
        self.reloaded = stamp[0] / 1e9

    def check(self) -> bool:
        """Re-read the file if its mtime or size changed (blocking: run it in a thread).
        True when new data was published."""
        try:
            st = os.stat(self.path)
            if self._stamp == (st.st_mtime_ns, st.st_size):
                return False
            table, stamp = _read(self.path, self.origins, self.reverse)
        except OSError as exc:
            if not self._read_failing:
                log.warning("plugin/hosts: %s: %s (keeping the last data)", self.path,
                            exc.strerror or exc)
            self._read_failing = True
            return False
        self.data = Snapshot(table, self.data.inline)     # one assignment: readers see old or new
        self._stamp = stamp
        self.reloaded = stamp[0] / 1e9
        if self._read_failing:
            log.info("plugin/hosts: %s readable again", self.path)
        self._read_failing = False
        log.debug("plugin/hosts: %s parsed into %d entries", self.path, len(table))
        return True

    async def start(self) -> None:
        _live.add(self)      # exported while serving (a Corefile reload's old plugins stop)
        if self.reload > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._reloader())

    async def stop(self) -> None:
        _live.discard(self)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _reloader(self) -> None:
        while True:
            await asyncio.sleep(self.reload)
            try:
                await asyncio.to_thread(self.check)
            except Exception:   # a bug in parsing must not end the reloads
                log.exception("plugin/hosts: reloading %s", self.path)

    # --- answering ----------------------------------------------------------------------

    def _falls(self, qname: str) -> bool:
        return bool(self.fall) and match_zone(self.fall, qname) is not None

    def transparent(self, qname: str, qtype: int) -> bool:
        data = self.data
        if qtype == PTR:
            address = reverse_address(qname)
            return address is None or not data.names(address)
        if match_zone(self.origins, qname) is None:
            return True
        if data.owner(qname) is not None:
            return self.fall_unsupported and qtype not in (A, AAAA) and self._falls(qname)
        return self._falls(qname)

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        qname, qtype = req.qname, req.qtype
        data = self.data
        in_zone = match_zone(self.origins, qname) is not None
        if not in_zone and qtype != PTR:
            return await next(req)
        rrs: list[dnslib.RR] = []
        owner_label = dnslib.DNSLabel([label.lower() for label in req.record.q.qname.label])
        if qtype == PTR:
            address = reverse_address(qname)
            names = data.names(address) if address else []
            if not names:
                return await next(req)
            rrs = [dnslib.RR(owner_label, PTR, ttl=self.ttl, rdata=dnslib.PTR(n)) for n in names]
        else:
            owner = data.owner(qname)
            if owner is None:
                if self._falls(qname):
                    return await next(req)
                # CoreDNS: no SOA to build an NXDOMAIN from, so SERVFAIL
                raise PluginError(reason="")
            if qtype in (A, AAAA):
                rd = dnslib.A if qtype == A else dnslib.AAAA
                rrs = [dnslib.RR(owner_label, qtype, ttl=self.ttl, rdata=rd(ip))
                       for ip in data.addresses(owner, qtype)]
            elif self.fall_unsupported and self._falls(qname):
                return await next(req)
        reply = req.reply()
        reply.rr = rrs
        req.note(f"hosts: {len(rrs)} answer(s)" if rrs else "hosts: NODATA")
        return reply

    def describe(self) -> str:
        parts = [self.path, *self.origins]
        d = self.data
        parts.append(f"entries={len(d.file) + len(d.inline)} (inline {len(d.inline)})")
        parts.append(f"ttl={self.ttl}")
        parts.append(f"reload={self.reload:g}s" if self.reload > 0 else "reload=off")
        if not self.reverse:
            parts.append("no_reverse")
        if self.fall:
            parts.append("fallthrough=" + ",".join(self.fall))
        if self.fall_unsupported:
            parts.append("fallthrough_unsupported")
        return " ".join(parts)


def _inline_entry(line: Directive) -> str:
    """An inline `IP NAME...` line, checked (the same parse the file gets must take it)."""
    fields = [line.name, *line.values]
    if len(fields) < 2 or _address(fields[0]) is None:
        raise plugin_error(line, f"unknown property '{line.name}' (not an option "
                                 f"({', '.join(OPTIONS)}) nor an 'IP NAME...' entry)", "hosts")
    for raw in fields[1:]:
        if not valid_name(fqdn(raw)):
            raise plugin_error(line, f"'{raw}' is not a valid host name", "hosts")
    return " ".join(fields)


def setup(d: Directive, ctx: SetupContext) -> Hosts:
    args = d.values
    path = DEFAULT_FILE
    if args:
        path = args[0]
        if not os.path.isabs(path):
            path = os.path.join(ctx.base_dir, path)
    origins = normalize_zones(args[1:], ctx.zones, d, "hosts")
    ttl, reverse, reload = DEFAULT_TTL, True, DEFAULT_RELOAD
    fall: list[str] | None = None
    fall_unsupported = False
    inline: list[str] = []
    for line in d.lines():
        name, vals = line.name, line.values
        if name == "fallthrough":
            fall = normalize_zones(vals, ["."], line, "hosts")
        elif name == "fallthrough_unsupported":
            if vals:
                raise plugin_error(line, "fallthrough_unsupported takes no arguments", "hosts")
            fall_unsupported = True
        elif name == "no_reverse":
            if vals:
                raise plugin_error(line, "no_reverse takes no arguments", "hosts")
            reverse = False
        elif name == "ttl":
            if not vals:
                raise plugin_error(line, "ttl needs a time in second", "hosts")
            if len(vals) > 1:
                raise plugin_error(line, "ttl takes one number of seconds", "hosts")
            try:
                ttl = int(vals[0], 10)
            except ValueError:
                raise plugin_error(line, "ttl needs a number of second", "hosts") from None
            if ttl <= 0 or ttl > 65535:
                raise plugin_error(line, "ttl provided is invalid", "hosts")
        elif name == "reload":
            if len(vals) != 1:
                raise plugin_error(line, "reload needs a duration (zero seconds to disable)", "hosts")
            try:
                reload = duration(vals[0])
            except ValueError:
                raise plugin_error(line, f"invalid duration for reload '{vals[0]}'", "hosts") from None
            if reload < 0:
                raise plugin_error(line, f"invalid negative duration for reload '{vals[0]}'", "hosts")
        elif fall is None:
            if line.body is not None:
                raise plugin_error(line, f"unknown property '{name}' (a block is not allowed here)", "hosts")
            inline.append(_inline_entry(line))
        else:
            # CoreDNS takes entries only before fallthrough
            raise plugin_error(line, f"unknown property '{name}' (inline entries must come before "
                                     "fallthrough)", "hosts")
        if line.body is not None:
            raise plugin_error(line, f"{name} takes no block", "hosts")
    if fall_unsupported and fall is None:
        raise plugin_error(d, "fallthrough_unsupported needs fallthrough")
    h = Hosts(path=path, origins=origins, inline=inline, ttl=ttl, reverse=reverse, reload=reload,
              fall=fall, fall_unsupported=fall_unsupported, where=d.where)
    try:
        h.load_initial()
    except OSError as exc:
        raise plugin_error(d, f"unable to access hosts file '{path}': {exc.strerror or exc}") from None
    return h
