"""Shared fixtures of the DNS engine tests: the demo cluster at a fixed serial, an engine factory."""
from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

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
    engine = Engine(replace(Config(), **options), forwarder, server_addresses)
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
