"""The DNS server: UDP and TCP sockets around the engine.

UDP: each socket is answered by a receive thread of its own (a blocking
recvmmsg for every datagram waiting, engine.fast(bytes) for each, one sendmmsg
for the replies; recvfrom/sendto where libc lacks those; no event-loop step,
task or parse per query); only when fast() returns None is the query handed to
the event loop, where a task runs engine.resolve() and sends the reply. The
thread counts its answers in a table of its own, handed over at scrape. With
--workers N every listen address gets N SO_REUSEPORT sockets and threads.
TCP (on the event loop) reads length-prefixed queries, answers pipelined
queries as they complete (several in flight per connection, RFC 7766), closes
idle connections and bounds how many are open.

A bug while answering one query never stops the server: the exception is
logged, counted in coredns_panics_total, and the client gets SERVFAIL (or
nothing when the packet has no readable header).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import json
import logging
import os
import socket
import struct
import subprocess
import threading
from time import monotonic, perf_counter
from typing import Any, Callable

from ..config import Config
from ..lograte import LogLimit
from ..state import ClusterState, Delta, StateStore
from . import metrics
from .forward import Forward

log = logging.getLogger(__name__)

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)      # Linux's value; Python does not always name it
RCVBUF = 4 << 20          # the kernel default (208 KiB here) drops queries far below capacity
SNDBUF = 1 << 20
TCP_IDLE_TIMEOUT = 10.0    # CoreDNS's idle timeout for TCP
NOTE_INTERVAL = 10.0       # seconds between log lines about what clients do (closed, evicted...)
TCP_MAX_INFLIGHT = 64      # unanswered queries per TCP connection
MAX_INFLIGHT = 2000        # resolve() tasks for UDP; beyond, queries are dropped (the client retries)
SERVFAIL = 2
PANIC_LOG_INTERVAL = 1.0   # seconds between logged tracebacks when every query fails


def error_reply(data: bytes, rcode: int) -> bytes | None:
    """A minimal reply with `rcode` built from the raw query (no parse); None if no header."""
    if len(data) < 12:
        return None
    flags = data[2] & 0x79 | 0x80          # QR set; opcode and RD kept; AA/TC cleared
    # Echo the first question if it can be delimited; else none.
    i, end, qd = 12, None, 0
    if data[4:6] != b"\x00\x00":
        while i < len(data) and i < 12 + 255:
            n = data[i]
            if n == 0:
                if i + 5 <= len(data):
                    end, qd = i + 5, 1
                break
            if n & 0xC0:
                break
            i += n + 1
    header = data[:2] + bytes((flags, rcode & 15)) + struct.pack("!HHHH", qd, 0, 0, 0)
    return header + (data[12:end] if end else b"")


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(host: str, port: int, reuse_port: bool = False,
          udp_reuse_port: bool = False) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on the same address; port 0 picks one free for both.

    reuse_port: SO_REUSEPORT on both (the agent: a restarted process shares the
    port with the previous one during its lameduck). udp_reuse_port: on the UDP
    socket, for more beside it (_bind_udp, --workers)."""
    fam = _family(host)
    for _attempt in range(20):
        if port == 0 and udp_reuse_port:
            # never autobind with SO_REUSEPORT (the kernel could pick a port another
            # SO_REUSEPORT socket holds): find a free port first, then bind it
            want = _free_port(host)
        else:
            want = port
        made: list[socket.socket] = []
        try:
            udp = _listener(fam, socket.SOCK_DGRAM, udp_reuse_port or bool(reuse_port and port))
            made.append(udp)
            tcp = _listener(fam, socket.SOCK_STREAM, bool(reuse_port and port))
            made.append(tcp)
            udp.bind((host, want))
            real = udp.getsockname()[1]
            tcp.bind((host, real))
            tcp.listen(1024)
            udp.setblocking(False)
            tcp.setblocking(False)
            return udp, tcp
        except OSError as exc:
            for s in made:
                s.close()
            if port == 0 and exc.errno == errno.EADDRINUSE:
                continue   # the UDP port was free but not the TCP one: pick another
            raise _cannot_listen(host, port, exc) from None
    raise OSError(errno.EADDRINUSE, f"cannot listen on {_show(host, port)}: no free port")


def _enable_pktinfo(sock: socket.socket) -> bool:
    """Ask for each datagram's destination address; False where the kernel will not say."""
    try:
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        return True
    except OSError:
        return False


def _destination(anc: list, family: int) -> bytes | None:
    """The query's destination address from recvmsg's ancillary data (in_pktinfo.ipi_addr,
    in6_pktinfo.ipi6_addr)."""
    for level, kind, raw in anc:
        if family == socket.AF_INET and level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(raw) >= 12:
            return raw[8:12]
        if family == socket.AF_INET6 and level == socket.IPPROTO_IPV6 and kind == socket.IPV6_PKTINFO \
                and len(raw) >= 16:
            return raw[:16]
    return None


def _free_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bind_udp(host: str, port: int) -> socket.socket:
    """One more UDP socket on the address of a _bind(..., reuseport=True) one (the kernel
    spreads datagrams over them by a hash of the client's address and port)."""
    udp = None
    try:
        udp = _listener(_family(host), socket.SOCK_DGRAM, True)
        udp.bind((host, port))
        return udp
    except OSError as exc:
        if udp is not None:
            udp.close()
        raise _cannot_listen(host, port, exc) from None


def _listener(fam: int, kind: int, reuse_port: bool) -> socket.socket:
    """An unbound socket as every listener has it: IPv6 only on IPv6; UDP with big buffers,
    TCP with SO_REUSEADDR; SO_REUSEPORT when asked."""
    s = socket.socket(fam, kind)
    try:
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if kind == socket.SOCK_DGRAM:
            _set_buffers(s)
        else:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        s.close()
        raise
    return s


def _cannot_listen(host: str, port: int, exc: OSError) -> OSError:
    return OSError(exc.errno, f"cannot listen on {_show(host, port)}: {exc.strerror or exc}")


def _set_buffers(sock: socket.socket) -> None:
    # SO_RCVBUFFORCE (root) passes net.core.rmem_max; SO_RCVBUF is capped by it.
    for force, plain, size in ((getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF, RCVBUF),
                               (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF, SNDBUF)):
        for opt in (force, plain):
            if opt is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                break
            except OSError:
                continue


def interface_addresses(device: str = "") -> list[str]:
    """Every address on this host's interfaces, or on one (a wildcard listener's NS records,
    a Corefile's `bind INTERFACE`)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"] + (["dev", device] if device else []),
                             capture_output=True, text=True, timeout=5).stdout
        return [a["local"] for link in json.loads(out or "[]") for a in link.get("addr_info", []) if "local" in a]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


class _Stats(metrics.ServerStats):
    """A listener's counters: the loop thread's (TCP, UDP through resolve()) plus what its
    receive threads counted on their own and hand over when asked (at scrape) or when full."""

    __slots__ = ("receivers",)

    def __init__(self, server: str, family: int, plugins=(), corefile: bool = False) -> None:
        super().__init__(server, family, plugins, corefile)
        self.receivers: list[_UdpReceiver] = []

    def fold(self) -> None:
        """Exact totals: every live receive thread first hands over what it counted."""
        live = [r for r in self.receivers if r.thread.is_alive()]
        if live and threading.current_thread() not in [r.thread for r in live]:
            for r in live:
                r.flushed.clear()
                r.flush_req = True
            # A zero-length datagram wakes a thread blocked in recvfrom. With several
            # SO_REUSEPORT sockets the kernel picks one by the sender's port, so send
            # from fresh ports until each has answered.
            deadline = monotonic() + _UdpReceiver.FLUSH_WAIT
            for r in live:
                while not r.flushed.is_set():
                    r.wake()
                    if r.flushed.wait(0.01) or monotonic() > deadline:
                        break
            late = [r for r in live if not r.flushed.is_set()]
            if late:
                log.warning("%d UDP receive thread(s) of %s did not hand over their counts in %gs",
                            len(late), self.server, _UdpReceiver.FLUSH_WAIT)
        for r in self.receivers:
            r.drain_into(self)
        super().fold()


class _FastPart:
    """The metrics part of an engine's fast() answers when it does not say (the flags' engine)."""
    part = metrics.FAST


_FAST_PART = _FastPart()


class _UdpReceiver:
    """One UDP socket answered by a thread of its own: blocking receive (recvmmsg batches,
    or recvfrom), engine.fast(), send, with no event-loop step per query. Misses go to the event loop (resolve() in a
    task) and are sent from there. The engine is read through one reference per query
    (Engine.fast reads its current view once), so a state swap needs no coordination.

    Counting stays in the thread (a plain dict, no lock): a scrape asks the thread to hand
    its table over (a zero-length datagram wakes it) and merges it on the loop thread, so
    the exported series are exact at scrape time.
    """

    FLUSH_WAIT = 1.0    # seconds a scrape waits for the thread to hand its counts over

    def __init__(self, service: "DnsService", stats: _Stats, sock: socket.socket,
                 loop: asyncio.AbstractEventLoop, engine=None) -> None:
        self.service, self.stats, self.sock, self.loop = service, stats, sock, loop
        self.engine = engine if engine is not None else service.engine   # what answers this socket
        # the metrics part of its fast() answers: a Corefile listener says per answer (its block)
        self.parts = self.engine if hasattr(self.engine, "part") else _FAST_PART
        host, port = sock.getsockname()[:2]
        # a wildcard address: reply from the address each query was sent to (the kernel would
        # pick the route's source, and a client that asked a secondary address drops that)
        self.pktinfo = host in ("0.0.0.0", "::") and _enable_pktinfo(sock)
        wake_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self.wake_addr = (wake_host, port)
        # the thread's own counters (never registered, never folded: handed over before full)
        self.local = metrics.ServerStats(stats.server, stats.family)
        self.outbox: collections.deque = collections.deque()   # tables handed to the loop thread
        self.flush_req = False
        self.flushed = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._main, name=f"dns-udp-{_show(host, port)}", daemon=True)

    def start(self) -> None:
        self.sock.setblocking(True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        try:
            self.sock.shutdown(socket.SHUT_RD)   # wakes recvfrom (ENOTCONN on UDP, but it wakes)
        except OSError:
            pass
        self.wake()
        self.thread.join(2.0)
        if not self.thread.is_alive():
            self._handoff()          # what it counted since the last scrape

    def drain(self) -> None:
        """Answer what is still queued on the socket (the thread has stopped), just before
        it is closed: with SO_REUSEPORT a successor shares the address, and queries the
        kernel gave this socket would otherwise be lost with it. Counted, and a failure
        answered SERVFAIL, as the receive loops do (runs on the loop, before the listener's
        stats are retired)."""
        sock, fast, stats = self.sock, self.engine.fast, self.stats
        try:
            sock.setblocking(False)
            for _ in range(4096):
                data, addr, dst = self._receive()
                if not data:
                    if addr is None:   # nothing queued (the socket is shut down for reading)
                        break
                    continue           # a wake-up datagram
                started = perf_counter()
                try:
                    with self.service.engine_lock:
                        reply = fast(data, False)
                        part = self.parts.part
                except Exception:
                    reply = self.service.panic(data)
                    if reply is not None:
                        self.send(reply, addr, dst)
                    stats.record(data, reply, False, started, metrics.SERVER)
                    continue
                if reply is not None:
                    self.send(reply, addr, dst)
                    stats.fast_udp(data, reply, started, part)
        except OSError:
            pass

    def wake(self) -> None:
        try:
            with socket.socket(_family(self.wake_addr[0]), socket.SOCK_DGRAM) as s:
                s.sendto(b"", self.wake_addr)
        except OSError:
            pass

    # -- receive thread ----------------------------------------------------------------

    def _handoff(self) -> None:
        """Give the loop thread what was counted so far; start a new table (thread side)."""
        self.outbox.append(self.local.udp)
        self.local.udp = {}

    def _woken(self) -> bool:
        """An empty datagram: a wake-up (the stop, or a scrape asking for the counts) or nothing
        to answer. True when the thread is to end."""
        if self.stopping:
            return True
        if self.flush_req:
            self.flush_req = False
            self._handoff()
            self.flushed.set()
        return False

    def _failed(self, data: bytes, addr, started: float, dst: bytes | None = None) -> None:
        """engine.fast() raised: SERVFAIL (server.panic counts and logs it), counted as the
        server's own reply."""
        reply = self.service.panic(data)
        if reply is not None:
            try:
                self.send(reply, addr, dst)
            except OSError:
                pass
        self.local.record(data, reply, False, started, metrics.SERVER)

    def _receive(self) -> tuple[bytes, Any, bytes | None]:
        """One datagram: (data, sender, the packed address it was sent to when pktinfo is on)."""
        if not self.pktinfo:
            data, addr = self.sock.recvfrom(65535)
            return data, addr, None
        data, anc, _flags, addr = self.sock.recvmsg(65535, socket.CMSG_SPACE(32))
        return data, addr, _destination(anc, self.sock.family)

    def send(self, reply: bytes, addr, dst: bytes | None = None) -> None:
        """Reply to `addr`; from `dst` (the packed address the query was sent to) when known."""
        if dst is None:
            self.sock.sendto(reply, addr)
        elif self.sock.family == socket.AF_INET:
            self.sock.sendmsg([reply], [(socket.IPPROTO_IP, IP_PKTINFO, struct.pack("@I4s4s", 0, dst, b"\0" * 4))],
                              0, addr)
        else:
            self.sock.sendmsg([reply], [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, struct.pack("@16sI", dst, 0))],
                              0, addr)

    def _main(self) -> None:
        io = _Mmsg.make(self.sock, self.pktinfo)
        if io is None:
            self._run()
        else:
            self._run_batched(io)

    def _run(self) -> None:
        """recvfrom/sendto (recvmsg/sendmsg with the destination address on a wildcard socket)."""
        fast, service, local = self.engine.fast, self.service, self.local
        lock = service.engine_lock
        receive, send, count, parts = self._receive, self.send, local.fast_udp, self.parts
        slow, call = self.service._udp_slow, self.loop.call_soon_threadsafe
        # handed over before ServerStats would fold on its own (one new key per query at most)
        check, near_full = 255, metrics.RAW_LIMIT - 256
        n = 0
        while True:
            try:
                data, addr, dst = receive()
            except OSError:
                if self.stopping:
                    return
                continue          # a transient error (ENOMEM...): keep receiving
            started = perf_counter()
            if not data:          # a wake-up, shutdown, or an empty datagram (nothing to answer)
                if self._woken():
                    return
                continue
            try:
                with lock:
                    reply = fast(data, False)
                    part = parts.part
            except Exception:
                self._failed(data, addr, started, dst)
                n |= check           # the table's size is checked below
            else:
                if reply is None:
                    call(slow, self, data, addr, started, dst)
                    continue
                try:
                    send(reply, addr, dst)
                except OSError:
                    pass
                count(data, reply, started, part)
            n += 1
            if not n & check and len(local.udp) >= near_full:   # odd traffic: let the loop fold it
                self._handoff()
                call(self.drain_into, self.stats)

    def _run_batched(self, io: "_Mmsg") -> None:
        """_run with recvmmsg/sendmmsg: every datagram waiting (up to _Mmsg.N) in one call,
        the replies in one call (the kernel's per-call cost shared; ~15% more queries per
        CPU-second under dnsperf than one recvfrom/sendto each). The engine lock is taken
        once per batch, and the batch's headers read in one call."""
        fast, service, local = self.engine.fast, self.service, self.local
        lock = service.engine_lock
        count, parts = local.fast_udp, self.parts
        slow, call = self.service._udp_slow, self.loop.call_soon_threadsafe
        near_full = metrics.RAW_LIMIT - io.N
        receive, headers, send, addr_of, point = io.receive, io.headers, io.send, io.addr_of, io.point
        rmv, smv, slot, trunc = io.rmv, io.smv, io.SLOT, io.MSG_TRUNC
        set_len, siov, iov_size, iov_len_at = io.size_t, io.siovmv, io.iov_size, io.iov_len_at
        # a wildcard socket: each reply leaves from the address its query was sent to
        pk, rctl, sctl, ctl, space, dst_at, src_at, alen = (io.pktinfo, io.rctl, io.sctl, io.CTL, io.ctl_space,
                                                            io.dst_at, io.src_at, io.alen)
        nowhere = bytes(alen)
        while True:
            got = receive()
            if got <= 0:
                if self.stopping:
                    return
                continue          # EINTR, ENOMEM...: keep receiving
            started = perf_counter()
            j = 0                 # replies queued: reply j answers datagram i (j <= i)
            with lock:
                for i, (cl, flags, n) in enumerate(headers(got)):
                    if not n or flags & trunc:   # a wake-up, shutdown, an empty or oversized datagram
                        if self._woken():
                            io.n = j
                            send()
                            return
                        continue
                    at = i * slot
                    data = bytes(rmv[at:at + n])
                    try:
                        reply = fast(data, False)
                    except Exception:
                        self._failed(data, addr_of(i), started, io.destination(i, cl) if pk else None)
                        continue
                    if reply is None or len(reply) > slot:
                        call(slow, self, data, addr_of(i), started, io.destination(i, cl) if pk else None)
                        continue
                    at, m = j * slot, len(reply)
                    smv[at:at + m] = reply
                    set_len(siov, j * iov_size + iov_len_at, m)
                    if j != i:
                        point(j, i)
                    if pk:
                        at = j * ctl + src_at
                        if cl == space:     # the kernel's IP(V6)_PKTINFO, the one message asked for
                            sctl[at:at + alen] = rctl[i * ctl + dst_at:i * ctl + dst_at + alen]
                        else:
                            sctl[at:at + alen] = nowhere      # no source asked: the kernel's choice
                    j += 1
                    count(data, reply, started, parts.part)
            io.n = j
            send()
            if pk:
                io.rearm(got)
            if len(local.udp) >= near_full:      # odd traffic: let the loop fold it
                self._handoff()
                call(self.drain_into, self.stats)

    # -- loop thread -------------------------------------------------------------------

    def drain_into(self, stats: metrics.ServerStats) -> None:
        """Take the tables the thread handed over into `stats` (loop thread): the same
        raw keys ServerStats counts, their [count, seconds] added."""
        while self.outbox:
            table = self.outbox.popleft()
            mine = stats.udp
            for key, v in table.items():
                have = mine.get(key)
                if have is None:
                    mine[key] = v
                else:
                    have[0] += v[0]
                    have[1] += v[1]
            if len(mine) >= metrics.RAW_LIMIT:
                metrics.ServerStats.fold(stats)


class _Mmsg:
    """recvmmsg/sendmmsg on one UDP socket through libc (ctypes; the GIL is released during
    the calls): fixed buffers of N slots, datagram i of a receive answered from slot i's
    source address. Python's socket module has neither call."""

    N = 64          # datagrams per call
    SLOT = 4096     # bytes per datagram; a bigger query (never a sane one) is dropped
    NAME = 32       # a sockaddr_in6 fits
    MSG_WAITFORONE = 0x10000
    MSG_TRUNC = 0x20

    CTL = 64        # control bytes per datagram: one in(6)_pktinfo message fits

    @classmethod
    def make(cls, sock: socket.socket, pktinfo: bool = False) -> "_Mmsg | None":
        if os.environ.get("CLUSTERDNS_RECVMMSG", "1") == "0":     # the benchmark's comparison
            return None
        try:
            return cls(sock, pktinfo)
        except (OSError, AttributeError, ImportError):   # no such libc calls here
            return None

    def __init__(self, sock: socket.socket, pktinfo: bool = False) -> None:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        c = ctypes

        class iovec(c.Structure):
            _fields_ = [("base", c.c_void_p), ("len", c.c_size_t)]

        class msghdr(c.Structure):
            _fields_ = [("name", c.c_void_p), ("namelen", c.c_uint32), ("iov", c.c_void_p),
                        ("iovlen", c.c_size_t), ("control", c.c_void_p), ("controllen", c.c_size_t),
                        ("flags", c.c_int)]

        class mmsghdr(c.Structure):
            _fields_ = [("hdr", msghdr), ("len", c.c_uint32)]

        N, SLOT, NAME = self.N, self.SLOT, self.NAME
        self.recvmmsg, self.sendmmsg = libc.recvmmsg, libc.sendmmsg
        self.recvmmsg.argtypes = [c.c_int, c.c_void_p, c.c_uint, c.c_int, c.c_void_p]
        self.sendmmsg.argtypes = [c.c_int, c.c_void_p, c.c_uint, c.c_int]
        self.fd, self.family = sock.fileno(), sock.family
        self.namelen = 16 if sock.family == socket.AF_INET else 28
        self.size = c.sizeof(mmsghdr)
        rbuf, sbuf, names = (c.create_string_buffer(N * SLOT), c.create_string_buffer(N * SLOT),
                             c.create_string_buffer(N * NAME))
        riov, siov = (iovec * N)(), (iovec * N)()
        rh, sh = (mmsghdr * N)(), (mmsghdr * N)()
        self._keep: tuple = (rbuf, sbuf, names, riov, siov, rh, sh)      # the kernel writes into these
        for i in range(N):
            riov[i].base, riov[i].len = c.addressof(rbuf) + i * SLOT, SLOT
            siov[i].base = c.addressof(sbuf) + i * SLOT
            rh[i].hdr.name, rh[i].hdr.namelen = c.addressof(names) + i * NAME, NAME
            rh[i].hdr.iov, rh[i].hdr.iovlen = c.addressof(riov) + i * c.sizeof(iovec), 1
            sh[i].hdr.namelen = self.namelen
            sh[i].hdr.iov, sh[i].hdr.iovlen = c.addressof(siov) + i * c.sizeof(iovec), 1
        self.rmv, self.smv = memoryview(rbuf).cast("B"), memoryview(sbuf).cast("B")
        self.rhmv, self.shmv = memoryview(rh).cast("B"), memoryview(sh).cast("B")
        self.siovmv, self.nmv = memoryview(siov).cast("B"), memoryview(names).cast("B")
        self.names_at, self.rh_at, self.sh_at = c.addressof(names), c.addressof(rh), c.addressof(sh)
        self.len_at, self.flags_at = mmsghdr.len.offset, msghdr.flags.offset
        self.iov_len_at, self.iov_size = iovec.len.offset, c.sizeof(iovec)
        self.ptr = struct.Struct("P").pack_into
        self.size_t = struct.Struct("N").pack_into
        # (msg_controllen, msg_flags, msg_len) of each received mmsghdr, one call per batch
        ctl_at = msghdr.controllen.offset
        hdr = struct.Struct(f"{ctl_at}x N {self.flags_at - ctl_at - c.sizeof(c.c_size_t)}x i "
                            f"{self.len_at - self.flags_at - 4}x I {self.size - self.len_at - 4}x")
        if hdr.size != self.size:
            raise OSError("unexpected struct mmsghdr layout")
        self._hdr = hdr
        # reply j goes to datagram j's sender unless point() says otherwise (restored after send)
        for i in range(N):
            sh[i].hdr.name = c.addressof(names) + i * NAME
        self._pointed: list[int] = []
        self.n = 0      # replies queued for send()
        # A wildcard socket (pktinfo): each datagram's IP(V6)_PKTINFO is received into its
        # control slot, and each reply carries one naming its source (the address asked).
        self.pktinfo = pktinfo
        self.ctl_space = self.dst_at = self.src_at = 0
        self.alen = 4 if sock.family == socket.AF_INET else 16
        rctl = sctl = c.create_string_buffer(1)
        if pktinfo:
            CTL = self.CTL
            v4 = sock.family == socket.AF_INET
            size = 12 if v4 else 20                 # struct in_pktinfo / in6_pktinfo
            level, kind = (socket.IPPROTO_IP, IP_PKTINFO) if v4 else (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO)
            head = socket.CMSG_LEN(0)
            self.ctl_space = socket.CMSG_SPACE(size)
            # in_pktinfo: ifindex, spec_dst, addr (the header's destination); in6_pktinfo: addr, ifindex
            self.dst_at, self.src_at = (head + 8, head + 4) if v4 else (head, head)
            rctl, sctl = c.create_string_buffer(N * CTL), c.create_string_buffer(N * CTL)
            cmsg = struct.pack("@Nii", socket.CMSG_LEN(size), level, kind)
            if len(cmsg) != head or self.ctl_space > CTL:
                raise OSError("unexpected struct cmsghdr layout")
            for i in range(N):
                rh[i].hdr.control, rh[i].hdr.controllen = c.addressof(rctl) + i * CTL, CTL
                sh[i].hdr.control, sh[i].hdr.controllen = c.addressof(sctl) + i * CTL, self.ctl_space
                c.memmove(c.addressof(sctl) + i * CTL, cmsg, len(cmsg))
        self._keep += (rctl, sctl)
        self.rctl, self.sctl = memoryview(rctl).cast("B"), memoryview(sctl).cast("B")
        self._armed = bytes(self.rhmv)     # the receive headers as the kernel must find them

    def rearm(self, got: int) -> None:
        """The first `got` receive headers as set up again (the kernel wrote the lengths of what
        it received into them: name, control)."""
        self.rhmv[:got * self.size] = self._armed[:got * self.size]

    def destination(self, i: int, controllen: int) -> bytes | None:
        """The packed address datagram i was sent to (pktinfo), None when the kernel did not say."""
        if controllen != self.ctl_space:
            return None
        at = i * self.CTL + self.dst_at
        return bytes(self.rctl[at:at + self.alen])

    def receive(self) -> int:
        """Block until at least one datagram is waiting; how many were read (<= 0: an error)."""
        self.n = 0
        return self.recvmmsg(self.fd, self.rh_at, self.N, self.MSG_WAITFORONE, None)

    def headers(self, got: int):
        """(msg_flags, length) of each of the `got` datagrams received."""
        return self._hdr.iter_unpack(self.rhmv[:got * self.size])

    def point(self, j: int, i: int) -> None:
        """Reply j goes to the sender of datagram i (a datagram before it was not answered here)."""
        self.ptr(self.shmv, j * self.size, self.names_at + i * self.NAME)
        self._pointed.append(j)

    def send(self) -> None:
        sent, n = 0, self.n
        while sent < n:
            r = self.sendmmsg(self.fd, self.sh_at + sent * self.size, n - sent, 0)
            sent += r if r > 0 else 1       # a reply the kernel refused (EPERM...) is skipped
        self.n = 0
        if self._pointed:
            for j in self._pointed:
                self.ptr(self.shmv, j * self.size, self.names_at + j * self.NAME)
            self._pointed.clear()

    def addr_of(self, i: int) -> tuple:
        raw = bytes(self.nmv[i * self.NAME:i * self.NAME + self.namelen])
        port = raw[2] << 8 | raw[3]
        if self.family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port, 0, int.from_bytes(raw[24:28], "little")


class _Locked:
    """Awaits a coroutine running each of its steps (up to its next suspension) holding a
    threading lock, so the receive threads never run engine code at the same time."""

    __slots__ = ("coro", "lock")

    def __init__(self, coro, lock: threading.Lock) -> None:
        self.coro, self.lock = coro, lock

    def __await__(self):
        send, throw, lock = self.coro.send, self.coro.throw, self.lock
        value: Any = None
        exc: BaseException | None = None
        while True:
            with lock:
                try:
                    waiting = send(value) if exc is None else throw(exc)
                except StopIteration as stop:
                    return stop.value
            try:
                value, exc = (yield waiting), None
            except BaseException as e:      # cancellation (or close) goes on into the coroutine
                value, exc = None, e


class _TcpConn:
    """An open DNS TCP connection: when it was last active and how many answers it awaits."""
    __slots__ = ("writer", "last", "inflight")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer, self.last, self.inflight = writer, monotonic(), 0


class DnsService:
    """The DNS half the agent composes: engine + listeners, fed by a StateStore.

        service = DnsService(cfg, store)
        await service.start()          # binds every cfg.listen_addresses() pair, UDP and TCP
        service.bound                  # [(host, port)] actually bound
        await service.stop()
    """

    def __init__(self, cfg: Config, store: StateStore, *, forwarder=None, engine=None,
                 reuse_port: bool = False, corefile=None) -> None:
        self.cfg = cfg
        self.reuse_port = reuse_port
        self.store = store
        # a Corefile (clusterdns/corefile/build.py): its listeners, each with its server blocks,
        # answer instead of the one engine the flags describe
        self.corefile = corefile
        if corefile is not None:
            self.forwarder, engine = None, corefile
        else:
            self.forwarder = forwarder if forwarder is not None else Forward.from_config(cfg)
        if engine is None:
            from .engine import Engine  # the answer engine (zone view, wire building)
            engine = Engine(cfg, self.forwarder, server_addresses=self.server_addresses)
        self.engine = engine
        self.bound: list[tuple[str, int]] = []
        self.tasks: set[asyncio.Future] = set()
        self._receivers: list[_UdpReceiver] = []
        # The engine's memos (LRU caches) are not thread-safe: fast() in the receive threads
        # and on the loop (TCP), and each step of resolve(), run holding this lock.
        self.engine_lock = threading.Lock()
        self._servers: list[asyncio.AbstractServer] = []
        self._stats: list[metrics.ServerStats] = []
        self._tcp_conns: dict[asyncio.StreamWriter, _TcpConn] = {}
        self._notes: dict[str, LogLimit] = {}
        self._iface_addresses: list[str] | None = None
        self._panic_log = LogLimit(PANIC_LOG_INTERVAL)
        store.subscribe(self._on_state)
        self.engine.update(store.current)

    def detach(self) -> None:
        """Stop following the state (a replaced or stopped server)."""
        self.store.unsubscribe(self._on_state)

    def udp_sockets(self) -> list[socket.socket]:
        """The UDP sockets this server receives on (the hand-over tells a successor's from them)."""
        return [r.sock for r in self._receivers]

    # -- state ---------------------------------------------------------

    def _on_state(self, old: ClusterState, new: ClusterState, delta: Delta) -> None:
        if self.corefile is not None:
            self.engine.update(new)
        else:   # only the changed Services are compiled again
            self.engine.update(new, None if delta.full else delta.services, old)

    @property
    def synced(self) -> bool:
        return bool(self.engine.synced)

    def server_addresses(self) -> list[str]:
        """The IPs this server answers on (wildcards expanded), for the zone's NS records."""
        out: list[str] = []
        for host, _port in self.bound:
            if host in ("0.0.0.0", "::"):
                if self._iface_addresses is None:
                    self._iface_addresses = interface_addresses()
                fam = _family(host)
                out += [a for a in self._iface_addresses if _family(a) == fam]
            else:
                out.append(host)
        return list(dict.fromkeys(out))

    # -- queries -------------------------------------------------------

    def panic(self, data: bytes) -> bytes | None:
        """Called from an except block: count, log (rate-limited), and build SERVFAIL."""
        metrics.panic()
        n = self._panic_log.due()
        if n:
            log.exception("answering a query failed (%d since the last report); replying SERVFAIL", n)
        return error_reply(data, SERVFAIL)

    def _udp_slow(self, receiver: _UdpReceiver, data: bytes, addr, started: float, dst: bytes | None = None) -> None:
        """A UDP query fast() did not answer, on the loop thread: resolve() in a task."""
        if len(self.tasks) >= MAX_INFLIGHT or receiver.stopping:
            receiver.stats.record(data, None, False, started)
            return
        task = asyncio.ensure_future(self._udp_resolve(receiver, data, addr, started, dst))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _udp_resolve(self, receiver: _UdpReceiver, data: bytes, addr, started: float,
                           dst: bytes | None = None) -> None:
        metrics.begin_resolve()
        reply = await self.resolve(data, addr[0], False, receiver.engine, addr[1])
        if isinstance(reply, list):      # a transfer is TCP only; the engine refuses it on UDP
            reply = reply[0] if reply else None
        if reply is not None and not receiver.stopping:
            try:
                receiver.send(reply, addr, dst)
            except OSError:
                reply = None
        receiver.stats.record(data, reply, False, started)

    async def resolve(self, data: bytes, client_ip: str, tcp: bool, engine=None,
                      client_port: int = 0) -> bytes | list[bytes] | None:
        engine = engine if engine is not None else self.engine
        try:
            if self.corefile is not None:
                return await _Locked(engine.resolve(data, client_ip, tcp, client_port), self.engine_lock)
            return await _Locked(engine.resolve(data, client_ip, tcp), self.engine_lock)
        except asyncio.CancelledError:
            raise
        except Exception:
            return self.panic(data)

    # -- TCP -----------------------------------------------------------

    def _tcp_handler(self, stats: metrics.ServerStats, engine=None) -> Callable:
        engine = engine if engine is not None else self.engine

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conns = self._tcp_conns
            if len(conns) >= self.cfg.dns.tcp_max_connections and not self._evict_idle():
                self._note("tcp-full", "TCP connection limit (%d) reached with none idle: "
                           "refused %d new connection(s)", self.cfg.dns.tcp_max_connections)
                writer.transport.abort()
                return
            conn = _TcpConn(writer)
            conns[writer] = conn
            try:
                await self._tcp_session(reader, writer, stats, conn, engine)
            except (ConnectionError, OSError):
                pass
            except Exception:
                metrics.panic()
                log.exception("TCP connection handler failed")
            finally:
                conns.pop(writer, None)
                writer.close()
        return handle

    async def _tcp_sweep(self) -> None:
        """Close TCP connections idle (no answer in flight, no whole query read) for
        TCP_IDLE_TIMEOUT, checked a few times per timeout."""
        while True:
            await asyncio.sleep(min(1.0, TCP_IDLE_TIMEOUT / 4))
            now = monotonic()
            for conn in list(self._tcp_conns.values()):
                if not conn.inflight and now - conn.last > TCP_IDLE_TIMEOUT:
                    self._tcp_conns.pop(conn.writer, None)
                    conn.writer.transport.abort()

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest (no query in flight); False if none is idle."""
        oldest = None
        for conn in self._tcp_conns.values():
            if not conn.inflight and (oldest is None or conn.last < oldest.last):
                oldest = conn
        if oldest is None:
            return False
        self._tcp_conns.pop(oldest.writer, None)
        oldest.writer.transport.abort()
        self._note("tcp-evict", "TCP connection limit (%d) reached: closed %d idle connection(s), "
                   "the oldest first", self.cfg.dns.tcp_max_connections)
        return True

    def _note(self, kind: str, msg: str, *args) -> None:
        """Log what clients make happen at most once per NOTE_INTERVAL per kind, with a count."""
        limit = self._notes.get(kind)
        if limit is None:
            limit = self._notes[kind] = LogLimit(NOTE_INTERVAL)
        n = limit.due()
        if n:
            log.info(msg, *args, n)

    async def _tcp_session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           stats: metrics.ServerStats, conn: "_TcpConn", engine=None) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        client_ip = peer[0]
        engine = engine if engine is not None else self.engine
        fast, elock = engine.fast, self.engine_lock
        parts = engine if hasattr(engine, "part") else _FAST_PART
        pending: set[asyncio.Future] = set()
        lock = asyncio.Lock()   # keeps each framed reply contiguous on the stream
        transport = writer.transport
        high = transport.get_write_buffer_limits()[1]

        async def send(replies: list[bytes]) -> None:
            async with lock:
                try:
                    for reply in replies:
                        writer.write(struct.pack("!H", len(reply)) + reply)
                except RuntimeError:
                    # uvloop raises this (not ConnectionError) writing to a transport the
                    # client reset: the client went away with answers in flight.
                    if writer.is_closing() or writer.transport.is_closing():
                        self._note("tcp-gone", "%d TCP client(s) went away with answers in flight")
                        raise ConnectionError("client went away") from None
                    raise
                if transport.get_write_buffer_size() <= high:
                    await writer.drain()      # not paused: returns at once (no task, no timer)
                    return
                try:
                    # A client that stops reading must not hold the connection forever.
                    await asyncio.wait_for(writer.drain(), TCP_IDLE_TIMEOUT)
                except asyncio.TimeoutError:
                    transport.abort()
                    raise ConnectionError("client stopped reading") from None

        async def slow(data: bytes, started: float) -> None:
            conn.inflight += 1
            try:
                metrics.begin_resolve()
                reply = await self.resolve(data, client_ip, True, engine, peer[1])
                replies = reply if isinstance(reply, list) else ([] if reply is None else [reply])
                if replies and not writer.is_closing():
                    try:
                        await send(replies)
                    except (ConnectionError, OSError):
                        pass
                stats.record(data, replies[0] if replies else None, True, started)
            finally:
                conn.inflight -= 1
                conn.last = monotonic()

        while True:
            # no timeout per read (a timer and a task per query): _tcp_sweep closes idle ones
            try:
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                data = await reader.readexactly(size)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            conn.last = monotonic()
            started = perf_counter()
            try:
                with elock:
                    reply = fast(data, True)
                    part = parts.part
            except Exception:
                reply, part = self.panic(data), metrics.SERVER
            if reply is not None:
                conn.inflight += 1
                try:
                    await send([reply])
                finally:
                    conn.inflight -= 1
                stats.record(data, reply, True, started, part)
                continue
            if len(pending) >= TCP_MAX_INFLIGHT:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.ensure_future(slow(data, started))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:   # the client finished sending: let its last answers go out
            await asyncio.wait(pending, timeout=6.0)

    # -- lifecycle -----------------------------------------------------

    async def start(self) -> None:
        """Bind every listen address (UDP and TCP); raises OSError naming the address that failed."""
        loop = asyncio.get_running_loop()
        try:
            for host, port, engine in self._plan():
                workers = max(1, self.cfg.dns.workers)
                udp, tcp = _bind(host, port, self.reuse_port, udp_reuse_port=workers > 1)
                real = udp.getsockname()[1]
                socks = [udp]
                try:
                    socks += [_bind_udp(host, real) for _ in range(workers - 1)]
                except OSError:
                    for x in socks + [tcp]:
                        x.close()
                    raise
                plugins = (engine.enabled() if self.corefile is not None
                           else metrics.plugins_for(self.cfg, self.forwarder))
                stats = _Stats(f"dns://{_show(host, real)}", 2 if _family(host) == socket.AF_INET6 else 1, plugins,
                               corefile=self.corefile is not None)
                metrics.register_server(stats)
                self._stats.append(stats)
                for sock in socks:
                    receiver = _UdpReceiver(self, stats, sock, loop, engine)
                    stats.receivers.append(receiver)
                    self._receivers.append(receiver)
                    receiver.start()
                server = await asyncio.start_server(self._tcp_handler(stats, engine), sock=tcp, limit=70000)
                self._servers.append(server)
                self.bound.append((host, real))
        except BaseException:
            await self.stop()
            raise
        if self.corefile is not None:
            await self.corefile.start()
            self._probe_loops()
        sweep = asyncio.ensure_future(self._tcp_sweep())
        self.tasks.add(sweep)
        sweep.add_done_callback(self.tasks.discard)
        if self.forwarder is not None and getattr(self.forwarder, "upstreams", None):
            task = asyncio.ensure_future(self._detect_loops())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _probe_loops(self) -> None:
        """Each block's loop plugin asks the block's first listener its probe name."""
        for block in self.corefile.blocks:
            for p in block.plugins:
                if p.name != "loop":
                    continue
                for (host, port), li in self.corefile.listeners.items():
                    if block in li.blocks.values():
                        real = dict(self.bound).get(host, port)
                        task = asyncio.ensure_future(p.send_probe(host, real))
                        self.tasks.add(task)
                        task.add_done_callback(self.tasks.discard)
                        break

    def _plan(self) -> list[tuple[str, int, Any]]:
        """(host, port, engine) of every listener: the Corefile's, else the flags' addresses."""
        if self.corefile is not None:
            return [(h, p, li) for (h, p), li in self.corefile.listeners.items()]
        return [(h, p, self.engine) for h, p in self.cfg.listen_addresses()]

    async def _detect_loops(self) -> None:
        try:
            await self.forwarder.detect_loops()
        except Exception:
            log.exception("loop detection failed")

    async def stop(self) -> None:
        for r in self._receivers:
            r.stopping = True
        for r in self._receivers:
            await asyncio.get_running_loop().run_in_executor(None, r.stop)
            r.stats.fold()           # keep what it counted
            r.stats.receivers.remove(r)
            r.drain()
            r.sock.close()
        for st in self._stats:
            metrics.retire_server(st)
        for s in self._servers:
            s.close()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for s in self._servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
        self._receivers.clear()
        self._servers.clear()
        if self.forwarder is not None and hasattr(self.forwarder, "close"):
            await self.forwarder.close()
        if self.corefile is not None:
            await self.corefile.stop()


def banner(service: DnsService) -> str:
    addrs = " ".join(_show(h, p) for h, p in service.bound)
    if service.corefile is not None:
        zones = sorted({z for b in service.corefile.blocks for z in b.zones})
        return (f"clusterdns dns {os.getpid()}: serving {service.corefile.path} ({len(service.corefile.blocks)} "
                f"server block(s): {' '.join(zones)}) on {addrs} (UDP+TCP)")
    up = getattr(service.forwarder, "upstreams", None)
    if service.forwarder is None:
        ups = "none (--no-upstream: REFUSED)"
    else:
        ups = ", ".join(u.address for u in up) if up else "none found (SERVFAIL)"
    return (f"clusterdns dns {os.getpid()}: serving {', '.join(service.cfg.dns.zones)} on {addrs} "
            f"(UDP+TCP); upstreams: {ups}")
