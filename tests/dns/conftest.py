"""Shared fixtures of the DNS engine tests: the demo cluster at a fixed serial, an engine factory."""
from __future__ import annotations

import asyncio
import sys

import dns.message
import pytest

from clusterdns.config import Config
from clusterdns.dns.engine import Engine
from clusterdns.sources.manifest import DEMO_MANIFEST, load_files, publish
from clusterdns.state import ClusterState, StateStore

SERIAL = 1_700_000_001


def make_state(records, clock: float = SERIAL - 1) -> ClusterState:
    store = StateStore(clock=lambda: clock)
    publish(store, records)
    return store.current


@pytest.fixture(scope="session")
def demo_records():
    records, skipped = load_files([DEMO_MANIFEST])
    assert not skipped
    return records


@pytest.fixture(scope="session")
def demo_state(demo_records) -> ClusterState:
    return make_state(demo_records)


def make_engine(state: ClusterState | None, forwarder=None, server_addresses=lambda: [], **options) -> Engine:
    engine = Engine(Config().with_options(**options), forwarder, server_addresses)
    if state is not None:
        engine.update(state)
    return engine


def query_wire(name: str, qtype: str = "A", **kw) -> bytes:
    return dns.message.make_query(name, qtype, **kw).to_wire()


def ask_wire(engine: Engine, wire: bytes, client_ip: str = "10.161.37.5", tcp: bool = False):
    """resolve() the query twice and fast() it: the three answers must be byte-identical."""
    first = asyncio.run(engine.resolve(wire, client_ip, tcp))
    fast = engine.fast(wire, tcp)
    if fast is not None:
        assert fast == first, "fast() and resolve() disagree"
    again = asyncio.run(engine.resolve(wire, client_ip, tcp))
    assert again == first
    return first


def ask(engine: Engine, name: str, qtype: str = "A", client_ip: str = "10.161.37.5", tcp: bool = False, **kw):
    wire = query_wire(name, qtype, **kw)
    reply = ask_wire(engine, wire, client_ip, tcp)
    assert isinstance(reply, bytes)
    return dns.message.from_wire(reply)


# Captured at import: other folders' conftest modules are also named "conftest"
# (tests/ is not a package) and replace this one in sys.modules later.
_SELF = sys.modules[__name__]


@pytest.fixture(scope="session")
def h():
    """These helpers, for test modules (tests/ is not a package)."""
    return _SELF


def lines(section) -> list[str]:
    """A message section as sorted zone-file lines, names lower-cased."""
    out = []
    for rrset in section:
        for line in rrset.to_text().splitlines():
            out.append(line.lower())
    return sorted(out)


class LiveServer:
    """The real DNS server (DnsService: UDP and TCP sockets) on 127.0.0.1, its event loop in a
    thread, answering from `records`; queried with dnspython over real sockets."""

    def __init__(self, records, **options) -> None:
        import threading

        from clusterdns.dns.server import DnsService
        forwarder = options.pop("forwarder", None)
        options.setdefault("no_upstream", forwarder is None)
        self.cfg = Config().with_options(listen=("127.0.0.1:0",), **options)
        self.store = StateStore(clock=lambda: SERIAL - 1)
        publish(self.store, records)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = DnsService(self.cfg, self.store, forwarder=forwarder)
        self._call(self.service.start())
        self.port = self.service.bound[0][1]

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def query(self, name: str, rdtype: str = "A", tcp: bool = False, timeout: float = 5.0, **kw):
        import dns.query
        q = dns.message.make_query(name, rdtype, **kw)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, "127.0.0.1", port=self.port, timeout=timeout)

    def close(self) -> None:
        self._call(self.service.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
