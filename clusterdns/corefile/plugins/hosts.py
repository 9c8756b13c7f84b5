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
import mmap
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import weakref
import zlib
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

    def has(self, name: str) -> bool:
        h = hash(name) & MASK
        return name in self.v4[h] or name in self.v6[h]

    def keys(self, kind: str) -> list[str]:
        return [k for d in getattr(self, kind) for k in d]


# A big file is parsed in a child process, which hands back the result packed in a memfd that
# this process maps (PackedTable): the parse holds no lock of ours (a thread of this process
# parsing holds the GIL, and on a busy machine the kernel preempts it while it does: the receive
# threads and the event loop then wait for it, 0.1-0.4 s at a time), and the old data goes in
# one munmap and close, which release the GIL, not as millions of objects freed under it (0.4 s
# per 200,000 lines). Lookups cost ~1 us more than a dict's.
BIG = 256 * 1024    # bytes: files up to this are parsed in this process (a few ms)
RELOAD_NICE = 10    # the child's nice increment on a reload

_HEAD = struct.Struct("=4sQQQQQQ")   # magic, names mask, ptr mask, skipped, wild, empty, entries
_MAGIC = b"CDH1"
_U32 = struct.Struct("=I")


class PackedTable:
    """A Table packed by pack(): two open-addressing hash tables (crc32, linear probing) of
    uint32 offsets into the buffer. A name's record is `len name len v4 len v6`, an address's
    `len address len names` (u8 key length, u32 value lengths, values space-joined)."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        magic, nmask, pmask, self.skipped, wild, empty, self.entries = _HEAD.unpack_from(buf, 0)
        if magic != _MAGIC:
            raise ValueError("not a packed hosts table")
        self.wild, self.empty = bool(wild), bool(empty)
        self.buf = buf
        view = memoryview(buf)
        at = _HEAD.size
        self.nslots = view[at:at + 4 * (nmask + 1)].cast("I")
        at += 4 * (nmask + 1)
        self.pslots = view[at:at + 4 * (pmask + 1)].cast("I")
        self.nmask, self.pmask = nmask, pmask

    def __len__(self) -> int:
        return self.entries

    def _find(self, slots, mask: int, key: str) -> int:
        """The offset just past `key` in its record, or -1."""
        if not key.isascii():
            return -1
        k = key.encode()
        n, buf = len(k), self.buf
        i = zlib.crc32(k) & mask
        while True:
            off = slots[i]
            if not off:
                return -1
            if buf[off] == n and buf[off + 1:off + 1 + n] == k:
                return off + 1 + n
            i = (i + 1) & mask

    def _value(self, at: int) -> tuple[str | None, int]:
        n = _U32.unpack_from(self.buf, at)[0]
        return (self.buf[at + 4:at + 4 + n].decode() if n else None), at + 4 + n

    def has(self, name: str) -> bool:
        return self._find(self.nslots, self.nmask, name) >= 0

    def get(self, kind: str, key: str) -> str | None:
        if kind == "ptr":
            at = self._find(self.pslots, self.pmask, key)
            return None if at < 0 else self._value(at)[0]
        at = self._find(self.nslots, self.nmask, key)
        if at < 0:
            return None
        v4, at = self._value(at)
        return v4 if kind == "v4" else self._value(at)[0]

    def keys(self, kind: str) -> list[str]:
        slots = self.pslots if kind == "ptr" else self.nslots
        out = []
        for off in slots:
            if off:
                n = self.buf[off]
                key = self.buf[off + 1:off + 1 + n].decode()
                if self.get(kind, key) is not None:
                    out.append(key)
        return out


def _slots(count: int) -> int:
    """A power of two at least twice `count` (probes stay short)."""
    n = 8
    while n < 2 * count:
        n *= 2
    return n


def pack(t: Table) -> bytes:
    """`t` as PackedTable reads it."""
    names: dict[str, None] = {}
    for maps in (t.v4, t.v6):
        for d in maps:
            names.update(dict.fromkeys(d))
    addresses = [k for d in t.ptr for k in d]
    nslots, pslots = _slots(len(names)), _slots(len(addresses))
    out = bytearray(_HEAD.pack(_MAGIC, nslots - 1, pslots - 1, t.skipped, t.wild, t.empty, len(t)))
    base = len(out)
    out += bytes(4 * (nslots + pslots))
    slots = memoryview(out)[base:].cast("I")   # both arrays; released before `out` grows

    def place(first: int, mask: int, key: bytes, at: int) -> None:
        i = zlib.crc32(key) & mask
        while slots[first + i]:
            i = (i + 1) & mask
        slots[first + i] = at

    records = bytearray()
    start = len(out)
    u32 = _U32.pack
    for name in names:
        k = name.encode()
        place(0, nslots - 1, k, start + len(records))
        v4 = t.get("v4", name) or ""
        v6 = t.get("v6", name) or ""
        records += bytes((len(k),)) + k + u32(len(v4)) + v4.encode() + u32(len(v6)) + v6.encode()
    for address in addresses:
        k = address.encode()
        place(nslots, pslots - 1, k, start + len(records))
        v = (t.get("ptr", address) or "").encode()
        records += bytes((len(k),)) + k + u32(len(v)) + v
    slots.release()
    if start + len(records) >= 1 << 32:
        raise OSError(errno.EFBIG, "hosts file too big (its table passes 4 GiB)")
    out += records
    return bytes(out)


@dataclass(frozen=True)
class Snapshot:
    """What the plugin answers from: the file's table and the inline one, looked up in
    that order (CoreDNS keeps the two apart and concatenates)."""
    file: Table | PackedTable
    inline: Table

    def owner(self, name: str) -> str | None:
        """The entry that answers for `name`: itself, or the wildcard one label up; None.
        (On the receive threads' path for every name: the common cases look up little.)"""
        f, i = self.file, self.inline
        if not f.empty and f.has(name) or not i.empty and i.has(name):
            return name
        if not (f.wild or i.wild):
            return None
        dot = name.find(".")
        if 0 <= dot < len(name) - 1:
            wild = "*" + name[dot:]
            if f.has(wild) or i.has(wild):
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


def _open(path: str) -> int:
    """The file opened for reading; OSError when it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not block the open
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(st.st_mode):   # a FIFO, /dev/zero: never read
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _read(path: str, origins: list[str], reverse: bool,
          nice: int = 0) -> tuple[Table | PackedTable, tuple[int, int]]:
    """The file parsed, and its (mtime_ns, size) as read (fstat of the open file, so they
    agree). Line by line here, or in a child process (at `nice`) when it is big."""
    fd = _open(path)
    try:
        st = os.fstat(fd)
        if st.st_size > BIG:
            try:
                return _read_apart(fd, origins, reverse, nice), (st.st_mtime_ns, st.st_size)
            finally:
                os.close(fd)
        fh = open(fd, encoding="utf-8", errors="replace")
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    with fh:
        table = parse(fh, origins, reverse)
    return table, (st.st_mtime_ns, st.st_size)


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_CHILD = "import sys; from clusterdns.corefile.plugins.hosts import _child; _child(sys.argv[1:])"


def _read_apart(fd: int, origins: list[str], reverse: bool, nice: int = 0) -> PackedTable:
    """The open file `fd` parsed and packed by a child process (blocking: a worker thread's,
    or setup's) into a memfd this process maps: nothing is copied here, and when the table
    goes its pages are freed by munmap/close, which run without the GIL."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    os.lseek(fd, 0, os.SEEK_SET)
    out = os.memfd_create("clusterdns-hosts", os.MFD_CLOEXEC)
    try:
        with subprocess.Popen([sys.executable, "-c", _CHILD, str(fd), str(out), str(nice), "1" if reverse else "0",
                               *origins],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              pass_fds=(fd, out), env=env) as proc:
            assert proc.stderr is not None
            err = proc.stderr.read().decode(errors="replace").strip()
            code = proc.wait()
        size = os.fstat(out).st_size
        if code != 0 or size < _HEAD.size:
            raise OSError(errno.EIO, f"parsing in a child process failed ({err.splitlines()[-1] if err else code})")
        return PackedTable(mmap.mmap(out, size, prot=mmap.PROT_READ))    # (holds its own dup of `out`)
    finally:
        os.close(out)


def _child(argv: list[str]) -> None:
    """The child's side of _read_apart: parse the file on fd argv[0], write the packed table
    to the memfd on argv[1]; argv[2] is its nice increment."""
    fd, out, nice, reverse, origins = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1", argv[4:]
    os.nice(nice)
    with open(fd, encoding="utf-8", errors="replace") as fh:
        table = parse(fh, origins, reverse)
    packed = pack(table)
    del table
    with open(out, "wb") as fh:
        fh.write(packed)


# Tables in use, by what they were read from: a Corefile reload sets every plugin up again (the
# reload plugin does so every 30 s to compare digests), and an unchanged big file must not be
# parsed each time. Tables are never changed once built, so plugins may share one.
_tables: "weakref.WeakValueDictionary[tuple, Table | PackedTable]" = weakref.WeakValueDictionary()


def _read_shared(path: str, origins: list[str], reverse: bool,
                 nice: int = 0) -> tuple[Table | PackedTable, tuple[int, int]]:
    """_read, or the table a plugin already holds of the file as it is now (same mtime and size)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, tuple(origins), reverse)
    table = _tables.get(key)
    if table is not None:
        return table, (st.st_mtime_ns, st.st_size)
    table, stamp = _read(path, origins, reverse, nice)
    if stamp == (st.st_mtime_ns, st.st_size):
        _tables[key] = table
    return table, stamp


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
        # set once the file's first read is done: until then this plugin's queries wait (a big
        # file is read in the background, so other blocks answer meanwhile)
        self.loaded = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future] = []

    # --- the data ---------------------------------------------------------------------

    def load_initial(self) -> None:
        """Read the file at setup: missing is a warning (CoreDNS), unreadable an error (raised).
        A big one is only checked here and read in a thread of its own (see `loaded`)."""
        try:
            fd = _open(self.path)
        except FileNotFoundError:
            log.warning("plugin/hosts: %s: file does not exist (serving inline entries until it appears)",
                        self.path)
            self._read_failing = True     # said once; its return is logged
            self._done()
            return
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size <= BIG:
            self._first_read()
        else:
            threading.Thread(target=self._first_read, name=f"hosts-{self.path}", daemon=True).start()

    def _first_read(self) -> None:
        try:
            table, stamp = _read_shared(self.path, self.origins, self.reverse)
        except OSError as exc:     # gone or changed since setup looked: as a failed reload
            log.warning("plugin/hosts: %s: %s (serving inline entries)", self.path, exc.strerror or exc)
            self._read_failing = True
        else:
            self.data = Snapshot(table, self.data.inline)
            self._stamp = stamp
            self.reloaded = stamp[0] / 1e9
            log.debug("plugin/hosts: %s parsed into %d entries", self.path, len(table))
        self._done()

    def _done(self) -> None:
        with self._lock:
            self.loaded.set()
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_wake, fut)

    async def _wait_loaded(self) -> None:
        with self._lock:
            if self.loaded.is_set():
                return
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
        await fut

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the first read is done (config check; a Corefile reload before it swaps)."""
        return self.loaded.wait(timeout)

    def check(self) -> bool:
        """Re-read the file if its mtime or size changed (blocking: run it in a thread).
        True when new data was published."""
        try:
            st = os.stat(self.path)
            if self._stamp == (st.st_mtime_ns, st.st_size):
                return False
            # a reload is background work: while it runs the old data answers, and a child at
            # nice 0 on a busy machine takes the CPU from the threads answering (0.2-0.5 s gaps
            # at load 9 on 2 CPUs; the setup's first read, which everything waits for, is not niced)
            table, stamp = _read_shared(self.path, self.origins, self.reverse, RELOAD_NICE)
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
            if not self.loaded.is_set():
                continue
            try:
                await asyncio.to_thread(self.check)
            except Exception:   # a bug in parsing must not end the reloads
                log.exception("plugin/hosts: reloading %s", self.path)

    # --- answering ----------------------------------------------------------------------

    def _falls(self, qname: str) -> bool:
        return bool(self.fall) and match_zone(self.fall, qname) is not None

    def transparent(self, qname: str, qtype: int) -> bool:
        if not self.loaded.is_set():
            return False
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
        if not self.loaded.is_set():
            await self._wait_loaded()
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
        self.wait_loaded()
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
